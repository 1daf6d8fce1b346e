"""kestrel: run language models whose weights do not fit in device memory.

    from kestrel_core import load
    model = load("/path/to/model")          # config.json + *.safetensors
    with model.open(policy="asymmetric", keep=2, backend="cpu_ref") as run:
        res = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=8)
    print(res.token_ids, res.text, res.ms_per_token, res.counters)
"""

from kestrel_core.engine.run import Model, load

__version__ = "0.1.0"
__all__ = ["Model", "load"]
