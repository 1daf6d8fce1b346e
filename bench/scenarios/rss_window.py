"""cpu_ref's weights mapping RSS against the window, on the ~320 MB small-300m preset (on the CPU).

    python -m bench rss-window [--preset small-300m] [--keeps 1,2,4,off] [--tokens 3]

The mapping's RSS (/proc/self/smaps, every mapping of the checkpoint's files) is read at every layer boundary by an
on_layer_advance observer, and once more after the generate; the record gives its peak for each keep beside the
policy's peak layers (asymmetric: min(L, 2 * keep)) plus the never-evicted tensors, and the tensors' bytes.
"""

from __future__ import annotations

from bench import models
from bench.options import keeps
from bench.log import log
from bench.observe import observing
from bench.prompt import prompt_for
from bench.rows import row
from bench.rss import tensor_table
from kestrel_core.hookspecs import hookimpl


def add_arguments(p) -> None:
    models.add_arguments(p)
    p.add_argument("--preset", default="small-300m")
    p.add_argument("--keeps", default="1,2,4,off", type=keeps())
    p.add_argument("--tokens", type=int, default=3)


class RssPeak:
    """The checkpoint mapping's peak RSS over a run, read at every layer boundary."""

    def __init__(self, files: list[str]):
        self.files, self.peak, self.samples = files, 0, 0

    def sample(self) -> None:
        from kestrel_core.formats.checkpoint import mapping_rss

        self.peak = max(self.peak, mapping_rss(self.files))
        self.samples += 1

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        self.sample()


def run(args, record) -> dict:
    from kestrel_core import load
    from kestrel_core.formats.tensor_table import unit_specs

    path = models.ensure_preset(args.models, args.preset)
    table, files = tensor_table(path)
    rows = []
    with load(path) as model:
        cfg = model.config
        L = cfg.num_hidden_layers
        specs = {spec.key: [name for name, _ in spec.tensors.values()] for spec in unit_specs(cfg)}
        streamed = {n for names in specs.values() for n in names}
        layer = sum(table.info(n).nbytes for n in specs[(0,)])
        resident = sum(table.info(n).nbytes for n in table.names() if n not in streamed)
        total = sum(table.info(n).nbytes for n in table.names())
        for text in args.keeps.split(","):
            keep = text if text == "off" else int(text)
            watch = RssPeak(files)
            with observing(watch):
                r = row(model, {"backend": "cpu_ref", "keep": keep}, prompt_for(cfg.vocab_size), args.tokens,
                        label=f"keep={keep}", inspect=lambda run, res: watch.sample() or {})  # the last layer's pages
            peak_layers = L if keep == "off" else min(L, 2 * keep)
            bound = peak_layers * layer + resident
            rows.append({"keep": keep, "policy": "off" if keep == "off" else "asymmetric", "peak_layers": peak_layers,
                         "peak_mapping_rss_bytes": watch.peak, "bound_bytes": bound, "samples": watch.samples,
                         "keep_plus_1_bound_bytes": None if keep == "off" else (keep + 1) * layer + resident,
                         **{k: r[k] for k in ("decode_ms", "step_modes", "steady_steps", "summary", "token_ids")}})
            log(f"keep={keep!s:4} peak mapping RSS {watch.peak / 2**20:8.2f} MiB; {peak_layers} layers + resident "
                f"= {bound / 2**20:8.2f} MiB (all tensors {total / 2**20:.2f} MiB)")
    return {"preset": args.preset, "layer_bytes": layer, "resident_bytes": resident, "tensor_bytes": total,
            "tokens": args.tokens, "rows": rows,
            "ids_identical_across_keeps": len({tuple(r["token_ids"]) for r in rows}) == 1}
