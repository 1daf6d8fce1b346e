"""cpu_ref's weights mapping RSS against the window, on the ~320 MB small-300m preset.

    python bench/rss_window.py [--keeps 1,2,4,off] [--tokens 3]

The mapping's RSS (/proc/self/smaps) is read at every layer boundary by an
on_layer_advance observer; the record gives its peak for each keep beside the
(keep+1)-layer bound the design promises and the bytes of the whole file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_record  # noqa: E402

from kestrel_core import plugins  # noqa: E402
from kestrel_core.config import KestrelConfig, parse_keep  # noqa: E402
from kestrel_core.engine import Model, open_run  # noqa: E402
from kestrel_core.generate import generate  # noqa: E402
from kestrel_core.hookspecs import hookimpl  # noqa: E402
from kestrel_core.tensor_table import linear_specs  # noqa: E402
from kestrel_core.presets import preset_config, write_checkpoint  # noqa: E402


class RssObserver:
    def __init__(self):
        self.peak = 0

    @hookimpl
    def on_layer_advance(self, window, layer, phase):
        self.peak = max(self.peak, window.backend.ckpt.mapping_rss())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keeps", default="1,2,4,off")
    p.add_argument("--tokens", type=int, default=3)
    args = p.parse_args()
    keeps = [parse_keep(k) for k in args.keeps.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(preset_config("small-300m"), Path(tmp) / "small-300m")
        with Model(path) as model:
            ckpt, cfg = model.checkpoint, model.config
            streamed = {n for l in range(cfg.num_hidden_layers) for n, _ in linear_specs(cfg, l).values()}
            layer = sum(ckpt.info(n).nbytes for n, _ in linear_specs(cfg, 0).values())
            resident = sum(ckpt.info(n).nbytes for n in ckpt.names() if n not in streamed)
            total = sum(ckpt.info(n).nbytes for n in ckpt.names())
            for keep in keeps:
                obs = RssObserver()
                plugins.load_plugins()
                plugins.pm.register(obs, name="rss-bench-observer")
                try:
                    cfg_run = KestrelConfig().override(residency__keep=keep, generation__max_new_tokens=args.tokens,
                                                       generation__stop_at_eos=False)
                    with open_run(model, cfg_run) as run:
                        generate(run, [1, 2, 3, 4], cfg_run.generation)
                        obs.on_layer_advance(run.window, 0, "end")  # the last layer's pages too
                finally:
                    plugins.pm.unregister(name="rss-bench-observer")
                peak_layers = run.policy.peak_layers()
                # asymmetric holds the last keep layers plus a window of keep: min(L, 2*keep) at its peak,
                # which is the (keep+1) at keep=1.
                bound = peak_layers * layer + resident
                rows.append({"keep": keep, "policy": run.policy.name, "peak_layers": peak_layers,
                             "peak_mapping_rss_bytes": obs.peak, "bound_bytes": bound,
                             "keep_plus_1_bound_bytes": None if keep == "off" else (keep + 1) * layer + resident})
                print(f"keep={keep!s:4} peak mapping RSS {obs.peak / 2**20:8.2f} MiB; {peak_layers} layers + resident "
                      f"= {bound / 2**20:8.2f} MiB (all tensors {total / 2**20:.2f} MiB)")
    record = {"preset": "small-300m", "layer_bytes": layer, "resident_bytes": resident, "tensor_bytes": total,
              "tokens": args.tokens, "rows": rows}
    print("record:", write_record("rss_window", record, [RESULTS])[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
