"""Layers split over ranks with torch.distributed (gloo, cpu_ref): each rank runs a contiguous part of the layers,
the hidden state passes from rank to rank, and greedy and sampled ids equal one process's, for 2 and 3 ranks, dense
and MoE, one sequence (``kestrel generate`` under torchrun) and a batch (the Python API). Ranks that disagree on the
settings are refused naming the difference; commands that do not run over ranks yet are refused before any loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from kestrel_core.cli import main
from kestrel_core.engine.pipeline import split
from kestrel_core.formats.tensor_table import linear_specs, small_specs, unit_specs
from kestrel_core.tools.presets import preset_config, write_checkpoint

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # serve_helpers, pipeline_job

import pipeline_job  # noqa: E402  (the batch a pipeline's tests run under torchrun, run here in one process too)

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pipeline")
    return {name: write_checkpoint(preset_config(name), d / name) for name in ("tiny", "tiny-moe", "tiny-llama")}


def torchrun(ranks: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def generate_ids(ranks: int, model: Path, keep: str, layers: int) -> list[int]:
    args = ["generate", "--model", str(model), "--backend", "cpu_ref", "--keep", keep, "--prompt-ids", "5,17,42,99",
            "--max-new-tokens", "10", "--temperature", "0", "--json"]
    if ranks == 1:
        done = subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
    else:
        done = torchrun(ranks, "-m", "kestrel_core.cli", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)  # one rank speaks: the others' output goes nowhere
    if ranks > 1:
        assert out["pipeline"]["ranks"] == ranks and sum(n for _, n in out["pipeline"]["parts"]) == layers
    return out["token_ids"]


# --- the split and a part's tensors ---------------------------------------------------------------------------------
def test_the_split_is_contiguous_and_its_largest_part_the_least_it_can_be():
    assert split([1] * 6, 2) == [(0, 3), (3, 3)]
    assert split([1] * 7, 3) in ([(0, 2), (2, 2), (4, 3)], [(0, 3), (3, 2), (5, 2)], [(0, 2), (2, 3), (5, 2)])
    assert split([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]  # a heavy first layer alone
    assert split([1, 1, 1, 1, 9], 3) == [(0, 2), (2, 2), (4, 1)]
    assert split([3], 1) == [(0, 1)]


def test_more_ranks_than_layers_is_refused():
    from kestrel_core.errors import ConfigError

    with pytest.raises(ConfigError, match="3 ranks for a model of 2 layers"):
        split([1, 1], 3)


def test_a_parts_layer_zero_names_the_checkpoints_layer_and_its_sparse_rule():
    cfg = preset_config("tiny-moe")
    cfg = attrs.evolve(cfg, decoder_sparse_step=2)  # every other layer sparse: the rule reads the checkpoint's index
    part = cfg.layers(1, 3)
    assert part.num_hidden_layers == 3 and part.first_layer == 1
    assert linear_specs(part, 0) == linear_specs(cfg, 1) and small_specs(part, 1) == small_specs(cfg, 2)
    assert [u.key for u in unit_specs(part)][0] == (0,)
    assert [part.moe_layer(i) for i in range(3)] == [cfg.moe_layer(i) for i in range(1, 4)] == [True, False, True]
    assert cfg.layers(1, 2).layers(1, 1).first_layer == 2  # a part of a part counts from the model's
    with pytest.raises(ValueError):
        cfg.layers(2, 3)
    with pytest.raises(ValueError, match="config.json"):
        part.to_hf_dict()


@pytest.mark.parametrize("rank, ranks, sends, receives", [(0, 3, [], [2]), (1, 3, [], []), (2, 3, [0], []),
                                                         (0, 2, [], [1]), (1, 2, [0], [])])
def test_only_rank_0_receives_the_logits(monkeypatch, rank, ranks, sends, receives):
    import torch
    import torch.distributed as dist

    from kestrel_core.engine.pipeline import Pipeline

    sent, got = [], []
    back = object()  # the logits' own group

    def send(t, dst, group=None):
        assert group is back
        sent.append(dst)

    def recv(t, src, group=None):
        assert group is back
        got.append(src)
        t.fill_(7.0)

    monkeypatch.setattr(dist, "send", send)
    monkeypatch.setattr(dist, "recv", recv)
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: pytest.fail("the logits are not broadcast"))
    pipe = Pipeline(rank, ranks, 0, 1, [(0, 1)] * ranks, back=back)
    mine = torch.full((2, 5), 3.0, dtype=torch.bfloat16) if pipe.last else None
    out = pipe.logits(mine, 2, 5, torch.device("cpu"))
    assert (sent, got) == (sends, receives)
    assert out.shape == (2, 5) and out.dtype == torch.float32
    assert float(out[0, 0]) == (3.0 if pipe.last else 7.0 if pipe.first else 0.0)


def test_a_part_holds_the_globals_it_uses():
    """The embeddings on the part that starts at layer 0, the final norm and lm_head on the one that ends the model (a
    tied lm_head is the embeddings: there too), nothing on a part between."""
    from kestrel_core.formats.tensor_table import global_specs

    untied = preset_config("tiny-llama")  # 5 layers
    assert set(global_specs(untied)) == {"embed", "norm", "lm_head"}
    assert set(global_specs(untied.layers(0, 2))) == {"embed"}
    assert set(global_specs(untied.layers(2, 1))) == set()
    assert set(global_specs(untied.layers(2, 3))) == {"norm", "lm_head"}
    assert set(global_specs(untied.layers(2, 3).layers(1, 2))) == {"norm", "lm_head"}
    assert set(global_specs(untied.layers(0, 3).layers(1, 2))) == set()  # a part of a part that stops short
    tied = preset_config("tiny")
    assert set(global_specs(tied.layers(3, 3))) == {"embed", "norm"}
    with pytest.raises(ValueError, match="config.json"):
        untied.layers(0, 4).to_hf_dict()


# --- ids across ranks -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_generate_over_ranks_gives_one_process_ids(models, name):
    layers = preset_config(name).num_hidden_layers
    want = generate_ids(1, models[name], "off", layers)
    assert generate_ids(2, models[name], "off", layers) == want
    assert generate_ids(3, models[name], "1", layers) == want  # a window of one layer on each rank's part


def test_a_batch_over_two_ranks_gives_one_process_ids(models, tmp_path):
    for name, keep in (("tiny", "2"), ("tiny-moe", "off"), ("tiny-llama", "off")):
        out = tmp_path / f"{name}.json"
        done = torchrun(2, str(HERE / "pipeline_job.py"), str(models[name]), keep, str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(out.read_text()) == pipeline_job.run(str(models[name]), keep)


def test_a_batch_whose_caches_grow_over_two_ranks_gives_one_process_ids(models, tmp_path):
    """Each rank's KV cache grows as a device's does (``Slots.reach``, on the step rank 0 tells it): every rank's cache
    grows through the same capacities, a parked slot moves with it, and the ids are one process's with a cache that
    held every position from the start."""
    for name in ("tiny", "tiny-moe"):
        out = tmp_path / f"{name}.json"
        done = torchrun(2, str(HERE / "pipeline_job.py"), str(models[name]), "off", str(out), env={"GROW_FLOOR": "4"})
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(out.read_text()) == pipeline_job.run(str(models[name]), "off")
        held = [json.loads(Path(f"{out}.rank{r}.grown.json").read_text()) for r in range(2)]
        assert held[0] == held[1] and held[0][0] == 4 and len(held[0]) >= 3, held


@pytest.mark.parametrize("name, keep, expert_mb", [("tiny", "off", 0), ("tiny", "1", 0), ("tiny-moe", "off", 0.05)])
def test_a_batch_over_three_ranks_runs_in_micro_batches_and_gives_one_process_ids(models, tmp_path, name, keep,
                                                                                  expert_mb):
    """A decode step of several rows goes through the pipeline in micro-batches (one a rank), so the ranks work at
    once; the rows are row-exact, so the cut changes no id. Rank 0 sends each micro-batch on as it is done: a resident
    rank runs its layers once a micro-batch, a windowed one (keep 1) once over every row. Through the expert table
    each rank hears what it hears without micro-batches (each micro-batch's routing lands in its own rows)."""
    out = tmp_path / "ids.json"
    done = torchrun(3, str(HERE / "pipeline_job.py"), str(models[name]), keep, str(out), "on", str(expert_mb))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    one: dict = {}
    assert got["ids"] == pipeline_job.run(str(models[name]), keep, "on", expert_mb, one)
    assert got["micro_batches"] is True and got["sends"] > got["decode_steps"] > 0  # steps of several rows in pieces
    assert (got["pieces"] > 0) == (keep == "off")  # a resident rank's layers ran on micro-batches past row 0
    if expert_mb:  # each rank's expert cache (its own budget) against the same ranks without micro-batches
        whole = tmp_path / "whole.json"
        done = torchrun(3, str(HERE / "pipeline_job.py"), str(models[name]), keep, str(whole), "off", str(expert_mb))
        assert done.returncode == 0, done.stderr[-3000:]
        for r in range(3):
            cut, plain = (json.loads(Path(f"{o}.rank{r}.json").read_text()) for o in (out, whole))
            assert {k: cut[k] for k in pipeline_job.COUNTERS} == {k: plain[k] for k in pipeline_job.COUNTERS}, r
        assert sum(json.loads(Path(f"{out}.rank{r}.json").read_text())["bytes_reread"] for r in range(3)) > 0


def test_cpu_ranks_take_no_micro_batches_by_default(models, tmp_path):
    out = tmp_path / "ids.json"
    done = torchrun(2, str(HERE / "pipeline_job.py"), str(models["tiny"]), "off", str(out), "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["micro_batches"] is False and got["sends"] == 0 and got["decode_steps"] > 0
    assert got["ids"] == pipeline_job.run(str(models["tiny"]), "off")
    # each rank computes on its share of the host's cores, not on every core (the ranks' threads would wait on each other)
    from backends.cpu_ref.backend import usable_cores

    for r in range(2):
        assert json.loads(Path(f"{out}.rank{r}.json").read_text())["threads"] == max(1, usable_cores() // 2)


def test_micro_batches_cut_the_rows_evenly_and_in_order():
    from kestrel_core.engine.pipeline import micro_batches

    assert micro_batches(8, 2) == [(0, 4), (4, 8)]
    assert micro_batches(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert micro_batches(2, 4) == [(0, 1), (1, 2)]  # no empty micro-batch
    assert micro_batches(1, 3) == [(0, 1)]


# --- what is refused ------------------------------------------------------------------------------------------------
def test_ranks_that_disagree_are_refused_naming_the_setting(models):
    """torchrun gives every rank the same flags; ranks whose settings differ all the same (here a script that opens
    each rank's run with a keep of its own) are refused on every rank, naming what differs."""
    script = ("import os, sys\nfrom kestrel_core import load\n"
              "with load(sys.argv[1]) as m, m.open(backend='cpu_ref', keep=1 + int(os.environ['RANK'])) as r:\n"
              "    pass\n")
    path = models["tiny"].parent / "disagree.py"
    path.write_text(script)
    done = torchrun(2, str(path), str(models["tiny"]))
    assert done.returncode != 0
    assert "pipeline rank 1 runs settings.residency.keep = 2 where rank 0 runs 1; start every rank with the same" in done.stderr


@pytest.mark.parametrize("argv", [["sweep", "--model", "m"], ["demo"]])
def test_commands_that_do_not_run_over_ranks_yet_are_refused_before_any_load(argv, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kestrel: error: kestrel {argv[0]} does not run over several ranks yet (torchrun started 2)")


def test_a_rank_past_the_first_follows_and_does_not_generate(models):
    """Rank 0 leads: a later rank's run generates nothing of its own (its steps are rank 0's), and one process has no
    one to follow."""
    from kestrel_core import load
    from kestrel_core.errors import ConfigError

    with load(models["tiny"]) as model, model.open(backend="cpu_ref") as run:
        with pytest.raises(ConfigError, match=r"run.follow\(\) is for a pipeline's ranks past the first, and this is "
                                              "one process"):
            run.follow()
    script = models["tiny"].parent / "leader_only.py"
    script.write_text("import os, sys\nfrom kestrel_core import load\n"
                      "with load(sys.argv[1]) as m, m.open(backend='cpu_ref') as r:\n"
                      "    if os.environ['RANK'] == '1':\n"
                      "        try:\n"
                      "            r.generate(prompt_ids=[1, 2], max_new_tokens=2)\n"
                      "        except Exception as e:\n"
                      "            print('REFUSED', e, flush=True)\n"
                      "        r.follow()\n"
                      "    else:\n"
                      "        print('IDS', r.generate(prompt_ids=[1, 2], max_new_tokens=2).token_ids, flush=True)\n")
    done = torchrun(2, str(script), str(models["tiny"]))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED this is rank 1 of a pipeline, which follows rank 0's steps: call run.follow() on it" in done.stdout
    assert "IDS [" in done.stdout


def test_a_batch_job_over_two_ranks_writes_one_process_lines(models, tmp_path):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": 5, "stop_at_eos": False}) + "\n"
                               for p in ([5, 17, 42], [1, 2, 3, 4, 5, 6], [9])))
    args = ["generate", "--model", str(models["tiny-moe"]), "--backend", "cpu_ref", "--prompts", str(prompts),
            "--max-batch", "2"]
    one = subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args, "--out", str(tmp_path / "one.jsonl")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(2, "-m", "kestrel_core.cli", *args, "--out", str(tmp_path / "two.jsonl"))
    assert two.returncode == 0, two.stderr[-3000:]

    def ids(name: str) -> list:
        return [json.loads(line)["token_ids"] for line in (tmp_path / name).read_text().splitlines()]

    assert ids("two.jsonl") == ids("one.jsonl") and len(ids("one.jsonl")) == 3


def test_serve_over_two_ranks_answers_as_one_process(models, tiny_ckpt, tmp_path):
    """Rank 0 serves and the other rank follows its steps: concurrent requests (a batch), greedy and seeded, equal
    one process's ids; SIGTERM ends both ranks cleanly."""
    from concurrent.futures import ThreadPoolExecutor

    from kestrel_core import load
    from bench.serve_process import ServeProcess
    from serve_helpers import chat_model

    model = chat_model(tiny_ckpt, tmp_path / "tiny")
    asks = [dict(prompt=[5, 17, 42], max_tokens=6, temperature=0), dict(prompt=[1, 2, 3, 4], max_tokens=5, temperature=0),
            dict(prompt=[9, 8], max_tokens=7, temperature=0.9, seed=3)]
    with load(model) as m, m.open(backend="cpu_ref") as run:
        want = [run.generate(prompt_ids=a["prompt"], max_new_tokens=a["max_tokens"], temperature=a["temperature"],
                             stop_at_eos=False, **({"seed": a["seed"]} if "seed" in a else {})).token_ids for a in asks]
    server = ServeProcess(model, "--backend", "cpu_ref", "--max-seq", "64", ranks=2, timeout=120)
    try:
        client = server.client()

        def ask(a: dict) -> list[int]:
            got = client.completions.create(model=server.name, **a, extra_body={"ignore_eos": True,
                                                                                "return_token_ids": True})
            return got.choices[0].token_ids

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, asks)) == want
        # SIGTERM to rank 0, the server: it shuts down, and the rank that follows it ends with it
        workers = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
        rank0 = next(int(p) for p in workers if b"RANK=0" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0"))
        os.kill(rank0, 15)
        assert server.proc.wait(60) == 0, "\n".join(server.lines[-30:])
    finally:
        server.stop()


def test_a_rank_that_dies_ends_the_run_on_every_rank(models, tmp_path):
    """Rank 1 exits in the middle of the run: rank 0, waiting on it, does not wait for ever (the process group's
    timeout is the bound; torchrun stops the ranks left once one fails)."""
    script = tmp_path / "dies.py"
    script.write_text("import os, sys\nfrom kestrel_core import load\n"
                      "with load(sys.argv[1]) as m, m.open(backend='cpu_ref') as r:\n"
                      "    if os.environ['RANK'] == '1':\n"
                      "        os._exit(3)\n"
                      "    r.generate(prompt_ids=[5, 17, 42], max_new_tokens=4)\n"
                      "print('rank 0 went on alone', flush=True)\n")
    done = torchrun(2, str(script), str(models["tiny"]), env={"KESTREL_PIPELINE_TIMEOUT_S": "60"})
    assert done.returncode != 0 and "rank 0 went on alone" not in done.stdout


@pytest.mark.parametrize("env, says", [({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not a whole number"),
                                       ({"WORLD_SIZE": "2", "RANK": "5"}, "WORLD_SIZE is 2 but RANK is '5'"),
                                       ({"WORLD_SIZE": "2", "RANK": "0", "KESTREL_PIPELINE_TIMEOUT_S": "-3"},
                                        "KESTREL_PIPELINE_TIMEOUT_S='-3' must be a number of seconds above 0"),
                                       ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "", "MASTER_PORT": ""},
                                        "rank 0 of 2 could not join the others"),
                                       ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
                                        "LOCAL_RANK is 3, past the 2 ranks this host runs"),
                                       ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "4"},
                                        "LOCAL_WORLD_SIZE is 4 but WORLD_SIZE is 2"),
                                       ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "no-such-host.invalid",
                                         "MASTER_PORT": "29500"}, "MASTER_ADDR='no-such-host.invalid' does not resolve"),
                                       ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port number")])
def test_a_broken_torchrun_environment_is_one_line_naming_it(models, env, says, monkeypatch, capsys):
    for k in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        if v:
            monkeypatch.setenv(k, v)
    rc = main(["generate", "--model", str(models["tiny"]), "--backend", "cpu_ref", "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_rank_that_follows_ends_with_one_line_when_rank_0_is_gone(models, tmp_path):
    """Rank 0 exits before telling a step; the rank that follows it, waiting without a timeout, does not wait for ever:
    it ends naming rank 0. (Started without torchrun, which would stop it first.)"""
    import socket

    script = tmp_path / "lost.py"
    script.write_text("import os, sys\nfrom kestrel_core import load\nfrom kestrel_core.errors import KestrelError\n"
                      "with load(sys.argv[1]) as m, m.open(backend='cpu_ref') as r:\n"
                      "    if os.environ['RANK'] == '0':\n"
                      "        os._exit(3)\n"
                      "    try:\n"
                      "        r.follow()\n"
                      "    except KestrelError as e:\n"
                      "        print('ERR', e, flush=True)\n"
                      "        os._exit(2)\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(models["tiny"])], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.PIPE, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (0, 1)]
    out = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 3 and procs[1].returncode == 2, out[1][1][-2000:]
    assert out[1][0].startswith("ERR rank 1 of 2 lost rank 0, whose steps it follows (") and \
        out[1][0].rstrip().endswith("; see rank 0's error")


def test_devices_starts_the_ranks_itself_and_gives_one_process_ids(models):
    """``--devices cpu,cpu``: kestrel starts two ranks with torchrun's environment, rank 0 prints; the ids are one
    process's."""
    args = ["generate", "--model", str(models["tiny"]), "--backend", "cpu_ref", "--prompt-ids", "5,17,42,99",
            "--max-new-tokens", "8", "--json"]
    one = subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    two = subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args, "--devices", "cpu,cpu"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    got = json.loads(two.stdout)
    assert got["pipeline"]["ranks"] == 2 and got["token_ids"] == json.loads(one.stdout)["token_ids"]


@pytest.mark.parametrize("devices", ["cpu,cpu", "cpu,cpu,cpu"])
def test_devices_json_gives_each_ranks_part_of_a_step_within_the_whole_step(models, devices):
    """Issue 59 item 5: ``generate --devices ... --json`` carries each rank's part of a decode step (the ms its
    layers took, sent to rank 0 at the end), one entry a rank, whose layers cover the model's once and in order; the
    whole step's time (ms_per_token, rank 0's step to step) is at least each rank's part, step by step."""
    args = ["generate", "--model", str(models["tiny"]), "--backend", "cpu_ref", "--prompt-ids", "5,17,42,99",
            "--max-new-tokens", "8", "--json", "--devices", devices]
    done = subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    ranks, layers = len(devices.split(",")), preset_config("tiny").num_hidden_layers
    parts = got["pipeline"]["rank_parts"]
    assert [p["rank"] for p in parts] == list(range(ranks))
    covered = [layer for p in parts for layer in range(p["layers"][0], p["layers"][1] + 1)]
    assert covered == list(range(layers))  # every layer once, in rank order
    assert [list(p) for p in got["pipeline"]["parts"]] == [[p["layers"][0], p["layers"][1] - p["layers"][0] + 1]
                                                           for p in parts]
    steps = got["decode_ms"]
    assert len(steps) == 7 and got["ms_per_token"] > 0
    for p in parts:
        assert p["decode_steps"] == len(steps) and len(p["part_ms"]) == len(steps)
        assert all(ms > 0 for ms in p["part_ms"]) and p["median_ms"] > 0
        assert all(whole >= part for whole, part in zip(steps, p["part_ms"]))  # a rank's part lies within its step
        assert got["ms_per_token"] >= p["median_ms"]


@pytest.mark.parametrize("devices, says", [
    ("cpu", "--devices 'cpu': give two or more devices, comma-separated"),
    ("cpu,,cpu", "give two or more devices"),
    ("tpu:0,tpu:1", "--devices 'tpu:0'"),
    ("cuda:0,cuda:0", "cuda:0"),  # twice, or no GPU here: either way before any rank starts
])
def test_bad_devices_are_one_line_before_any_rank_starts(models, devices, says, capsys):
    rc = main(["generate", "--model", str(models["tiny"]), "--prompt-ids", "1", "--devices", devices])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and err.count("\n") == 1 and "rank" not in err.split("error:")[0]


@pytest.mark.parametrize("argv, says", [
    (["sweep", "--devices", "cpu,cpu"], "kestrel sweep does not run over several ranks yet; drop --devices"),
    (["generate", "--device", "cpu", "--devices", "cpu,cpu"], "pass --device or --devices, not both")])
def test_devices_with_what_cannot_run_over_ranks_is_refused_up_front(models, argv, says, capsys):
    assert main([*argv, "--model", str(models["tiny"])]) == 2
    assert capsys.readouterr().err == f"kestrel: error: {says}\n"


def test_devices_naming_more_ranks_than_torchrun_started_is_refused(models):
    done = torchrun(2, "-m", "kestrel_core.cli", "generate", "--model", str(models["tiny"]), "--backend", "cpu_ref",
                    "--prompt-ids", "1,2", "--devices", "cpu,cpu,cpu")
    assert done.returncode != 0
    assert "--devices names 3 devices but 2 ranks were started; give one device a rank" in done.stderr
    assert "kestrel (rank 1): error: --devices names 3 devices" in done.stderr  # each rank says its own


def test_serve_with_devices_ends_both_ranks_on_one_sigterm(models, tiny_ckpt, tmp_path):
    """``kestrel serve --devices cpu,cpu``: a SIGTERM to kestrel (as a supervisor sends) reaches rank 0, which shuts
    down; the rank that follows it ends with it, and kestrel exits."""
    from bench.serve_process import ServeProcess
    from serve_helpers import chat_model

    server = ServeProcess(chat_model(tiny_ckpt, tmp_path / "tiny"), "--backend", "cpu_ref", "--max-seq", "64",
                          "--devices", "cpu,cpu", timeout=120)
    try:
        got = server.client().completions.create(model=server.name, prompt=[5, 17, 42], max_tokens=3,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        assert len(got.choices[0].token_ids) == 3
        ranks = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
        assert len(ranks) == 2
        server.proc.send_signal(15)
        assert server.proc.wait(90) == 128 + 15  # kestrel says it was stopped
        assert not any(Path(f"/proc/{r}").exists() and "zombie" not in Path(f"/proc/{r}/status").read_text()
                       for r in ranks)
    finally:
        server.stop()


def test_chat_with_devices_reads_its_lines_on_rank_0_and_answers_as_one_process(tiny_ckpt, tmp_path):
    """Rank 0 reads the messages from stdin and answers (the other rank's stdin is closed: it follows)."""
    from serve_helpers import chat_model

    model = chat_model(tiny_ckpt, tmp_path / "tiny")
    args = [sys.executable, "-m", "kestrel_core.cli", "chat", "--model", str(model), "--backend", "cpu_ref",
            "--max-new-tokens", "5", "--json"]
    lines = "Hi there\nAnd again\n"
    one = subprocess.run(args, input=lines, capture_output=True, text=True, timeout=300, cwd=ROOT)
    two = subprocess.run([*args, "--devices", "cpu,cpu"], input=lines, capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    replies = [json.loads(line)["token_ids"] for line in two.stdout.splitlines()]
    assert len(replies) == 2 and replies == [json.loads(line)["token_ids"] for line in one.stdout.splitlines()]


def test_a_draft_model_beside_rank_0_stays_whole_and_ids_equal_one_process(models):
    """``--draft MODEL`` over ranks: rank 0 drafts with the whole small model on its device (its run does not join the
    pipeline, which would wait on ranks that never open it); greedy ids equal one process's without a draft."""
    tiny = str(models["tiny"])
    small = write_checkpoint(preset_config("tiny", layers=2), models["tiny"].parent / "tiny-2")
    args = ["generate", "--model", tiny, "--backend", "cpu_ref", "--prompt-ids", "5,17,42,99", "--max-new-tokens", "8",
            "--json"]
    plain = subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    drafted = torchrun(2, "-m", "kestrel_core.cli", *args, "--draft", str(small), "--draft-tokens", "3",
                       env={"KESTREL_PIPELINE_TIMEOUT_S": "60"})
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr[-3000:]
    got = json.loads(drafted.stdout)
    assert got["token_ids"] == json.loads(plain.stdout)["token_ids"] and got["pipeline"]["ranks"] == 2


@pytest.mark.parametrize("name, where", [("model.layers.4.mlp.down_proj.weight", "layer 4"),  # rank 1's part
                                         ("model.layers.1.self_attn.k_proj.weight", "layer 1")])  # rank 0's
def test_non_finite_weights_on_any_rank_are_named_by_their_layer(models, tmp_path, name, where):
    """Every rank probes its own part and rank 0 names the earliest finding, by the model's layer number."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = Path(shutil.copytree(models["tiny"], tmp_path / "tiny"))
    (weights,) = d.glob("*.safetensors")
    tensors = load_file(str(weights))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[:7] = float("nan")
    save_file(tensors, str(weights))
    done = torchrun(2, "-m", "kestrel_core.cli", "generate", "--model", str(d), "--backend", "cpu_ref",
                    "--prompt-ids", "0,1,2,3,4,5,6", "--max-new-tokens", "2")
    assert done.returncode != 0
    assert f"hold NaN or inf, first in the output of {where}:" in done.stderr, done.stderr[-2000:]


def test_a_trace_over_ranks_is_refused_before_any_load(monkeypatch, capsys, tmp_path):
    """A trace records every layer's routing; over ranks rank 0 would write its part alone."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["generate", "--model", "m", "--prompt-ids", "1", "--trace", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err == ("kestrel: error: --trace records the expert routing of every layer, but over "
                                       "several ranks each holds a part of the layers; record the trace as one "
                                       "process\n")
