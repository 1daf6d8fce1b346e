"""A pass's rows by kind: decode rows and verify spans first, a prompt's rows (its chunks') last, and
``Attend.prompt_from`` the first of those. A backend may compute a prompt's rows by other kernels than a decode row's
(``Backend.prompt_linear``; cuda's GGUF blocks with ``gguf_kernels = "auto"``): a sequence's ids then stay its solo
ids beside any companions, a verify pass's ids stay plain greedy's, because a row's kind never follows the rows
beside it. Here a backend whose prompt rows are computed differently holds the core to that."""

from __future__ import annotations

import pytest
import torch

from backends.cpu_ref.backend import CpuRefBackend
from kestrel_core import load
from kestrel_core.engine.model import Attend, Span
from kestrel_core.hookspecs import hookimpl
from kestrel_core.tools.presets import preset_config, write_checkpoint


def _attend(*spans: Span) -> Attend:
    z = torch.zeros(0)
    return Attend(z, z, z, z, decode_rows=2, spans=spans)


def test_a_pass_names_its_first_prompt_row():
    verify, prompt, chunk = Span(0, 2, 7, 3, verify=True), Span(1, 5, 0, 4), Span(2, 9, 4, 2)
    assert _attend().prompt_from is None  # decode rows alone
    assert _attend(verify).prompt_from is None
    assert _attend(prompt).prompt_from == 5
    assert _attend(verify, prompt, chunk).prompt_from == 5
    assert _attend(verify, Span(3, 5, 9, 2, verify=True), chunk).prompt_from == 9
    with pytest.raises(ValueError, match="prompt spans come after its verify spans"):
        _attend(prompt, verify).prompt_from

    class Rope:  # cos and sin of each position (their values are not what is tested)
        @staticmethod
        def at(positions):
            return torch.zeros(len(positions), 8), torch.zeros(len(positions), 8)

    assert Attend.prefill(Rope, 4, 3, "cpu").prompt_from == 0  # one sequence's prompt: every row


class PromptRowsApart(CpuRefBackend):
    """cpu_ref whose prompt rows go through another linear (scaled by 1.25: unlike any decode row's), and which
    records each pass's first prompt row."""

    name = "prompt_rows_apart"
    seen: list[tuple[int, int]] = []

    def prompt_linear(self, prompt_from):
        def linear(x, w):
            self.seen.append((prompt_from, x.shape[0]))
            y = self.linear(x, w)
            return torch.cat((y[:prompt_from], 1.25 * y[prompt_from:]))
        return linear


class Plugin:
    @hookimpl
    def register_backends(self, register):
        register(PromptRowsApart.name, PromptRowsApart)


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory):
    return write_checkpoint(preset_config("tiny", layers=2), tmp_path_factory.mktemp("draft") / "tiny-2")


PROMPTS = [[5, 17, 42, 99, 3, 5, 17, 42, 99, 3, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


def test_prompt_rows_computed_apart_leave_every_sequence_its_solo_ids(tiny_ckpt, draft_ckpt, register_plugin):
    register_plugin(Plugin(), "prompt-rows-apart")
    PromptRowsApart.seen = []
    backend = {"name": PromptRowsApart.name}
    with load(tiny_ckpt) as model:
        with model.open(keep=1, backend=backend) as run:
            solo = [run.generate(prompt_ids=p, max_new_tokens=8, stop_at_eos=False).token_ids for p in PROMPTS]
        with model.open(keep=1, backend={"name": "cpu_ref"}) as run:
            plain = [run.generate(prompt_ids=p, max_new_tokens=8, stop_at_eos=False).token_ids for p in PROMPTS]
        assert solo != plain  # the prompt's rows are computed apart, and it shows in the ids
        assert {(f, n) for f, n in PromptRowsApart.seen} >= {(0, len(p)) for p in PROMPTS}  # a prompt alone: from row 0
        PromptRowsApart.seen = []
        with model.open(keep=1, backend=backend, draft=str(draft_ckpt), draft_tokens=3) as run:
            # prompts join while others decode and verify drafts; a chunk of 4 splits the longer prompts over passes
            got = run.generate_batch([dict(prompt_ids=p, max_new_tokens=8, stop_at_eos=False) for p in PROMPTS],
                                     max_batch=3, prefill_chunk=4)
            drafted = sum(r.speculative["drafted"] for r in got if r.speculative)
    assert [r.token_ids for r in got] == solo
    assert drafted > 0  # verify spans ran, beside prompt chunks and decode rows
    assert any(0 < f < n for f, n in PromptRowsApart.seen)  # a pass with decode or verify rows before its prompt's
