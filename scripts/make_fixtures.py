#!/usr/bin/env python3
"""The tiny Gemma fixtures of tests/fixtures/tiny-gemma, from HF transformers.

Pinned versions (the committed references were made with these):
    torch==2.15.0          (PyPI wheel; CPU is enough)
    transformers==5.23.0
    safetensors

Each fixture directory holds config.json, model.safetensors and reference.json: 40 input ids, the
float32 logits of every position (one forward pass on the CPU) and 12 greedy tokens after the
first 10 ids (HF's generate, greedy, KV cache on).

    make_fixtures.py check [DIR ...]
        Recomputes reference.json from each committed checkpoint (config.json + model.safetensors)
        and compares: every logit within --tolerance (default 1e-5; times the largest logit where
        that is above 1) and the same greedy ids. Exits 1 on any difference. Without DIR: every
        fixture under tests/fixtures/tiny-gemma.

        gemma3-bf16 does not pass: its committed logits are 5.2e-4 from what transformers 5.23
        computes on its stored bf16 weights (in float32, however loaded), which is also what this
        crate computes; the run that made it is not known. Its weights are gemma3's rounded to
        bf16 (checked bit for bit). CI checks the other fixtures.

    make_fixtures.py references DIR [DIR ...]
        Writes reference.json for checkpoints (after their weights change).

    make_fixtures.py new TEMPLATE OUT --seed S
        A new checkpoint of TEMPLATE's config with other random weights (seed S): matrices
        normal(0, 0.02) as HF initializes them, then norm weights, layer scalars and router scales
        drawn around their neutral value so that none of them is trivial, as the committed
        fixtures have them; then its reference.json. The committed weights came from an earlier
        run of the same recipe (seed 7) whose exact draw order is not reproduced here: `check`
        is what ties the committed references to transformers.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "tiny-gemma"
INPUT_LEN = 40
GREEDY_PROMPT = 10
GREEDY_NEW = 12


def load_model(directory: Path):
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_file(directory / "model.safetensors")
    state = {k: v.to(torch.float32) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied output weights are not stored.
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"{directory}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def references(model, input_ids):
    ids = torch.tensor([input_ids])
    logits = model(ids).logits[0].to(torch.float32)
    prompt = ids[:, :GREEDY_PROMPT]
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=GREEDY_NEW,
        min_new_tokens=GREEDY_NEW,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )
    greedy = out[0, GREEDY_PROMPT:].tolist()
    return logits, greedy


def write_reference(directory: Path, input_ids, note: str):
    model = load_model(directory)
    logits, greedy = references(model, input_ids)
    reference = {
        "reference": f"HF transformers {__import__('transformers').__version__} "
        f"{type(model).__name__}, float32 on CPU, {note}",
        "input_ids": input_ids,
        "logits": [[round(float(v), 6) for v in row] for row in logits],
        "greedy_prompt_ids": input_ids[:GREEDY_PROMPT],
        "greedy_ids": greedy,
    }
    (directory / "reference.json").write_text(json.dumps(reference))
    print(f"{directory}: wrote reference.json ({len(input_ids)} positions, greedy {greedy})")


def check(directories, tolerance: float) -> bool:
    ok = True
    for directory in directories:
        committed = json.loads((directory / "reference.json").read_text())
        model = load_model(directory)
        logits, greedy = references(model, committed["input_ids"])
        want = torch.tensor(committed["logits"], dtype=torch.float32)
        err = (logits - want).abs().max().item()
        # The committed logits are rounded to 6 decimals (5e-7 of the difference). The bound is
        # absolute for logits within +-1, relative to the largest logit beyond (Gemma 4's tiny
        # models reach 3: their attention at scale 1 over QK-normed heads magnifies the order of
        # float32 sums, which differs between torch builds).
        scale = max(1.0, want.abs().max().item())
        same_greedy = greedy == committed["greedy_ids"]
        passed = err <= tolerance * scale and same_greedy
        ok &= passed
        greedy_note = "equal" if same_greedy else f"{greedy} vs {committed['greedy_ids']}"
        verdict = "ok" if passed else "DIFFERS"
        print(
            f"{directory.name}: max |logit - committed| {err:.2e} (logit scale {scale:.2f}, bound {tolerance * scale:.1e}), "
            f"greedy {greedy_note}: {verdict}"
        )
    return ok


def new_checkpoint(template: Path, out: Path, seed: int):
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((template / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings", True):
            continue
        if tensor.dtype != torch.float32:
            state[name] = tensor.contiguous()
            continue
        if tensor.dim() >= 2:
            value = torch.randn_like(tensor) * 0.02
        elif "layer_scalar" in name or "scale" in name or config["model_type"].startswith("gemma4"):
            # Gemma 4 multiplies by its norm weights, scalars and router scales (neutral 1).
            value = 1.0 + 0.2 * torch.randn_like(tensor)
        else:
            # Gemma 1-3 norms scale by 1 + weight (neutral 0).
            value = 0.2 * torch.randn_like(tensor)
        state[name] = value.contiguous()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    generator = torch.Generator().manual_seed(seed)
    vocab = config["vocab_size"]
    input_ids = [config.get("bos_token_id", 2)] + torch.randint(4, vocab, (INPUT_LEN - 1,), generator=generator).tolist()
    write_reference(out, input_ids, f"random weights (seed {seed}), weights stored as float32")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check")
    c.add_argument("dirs", nargs="*", type=Path)
    c.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: one reduction order)")
    r = sub.add_parser("references")
    r.add_argument("dirs", nargs="+", type=Path)
    n = sub.add_parser("new")
    n.add_argument("template", type=Path)
    n.add_argument("out", type=Path)
    n.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.command == "check":
        dirs = args.dirs or sorted(p for p in FIXTURES.iterdir() if (p / "reference.json").exists())
        sys.exit(0 if check(dirs, args.tolerance) else 1)
    if args.command == "references":
        for d in args.dirs:
            committed = json.loads((d / "reference.json").read_text())
            write_reference(d, committed["input_ids"], committed["reference"].split(", float32 on CPU, ", 1)[-1])
    if args.command == "new":
        new_checkpoint(args.template, args.out, args.seed)


if __name__ == "__main__":
    main()
