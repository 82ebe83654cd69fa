#!/usr/bin/env python3
"""Tiny Gemma 4 assistant (multi-token prediction drafter) fixtures, from HF transformers 5.23.

Pinned versions as scripts/make_fixtures.py (torch==2.15.0, transformers==5.23.0, safetensors).

Each fixture directory under tests/fixtures/tiny-gemma-assistant holds an assistant checkpoint
(config.json + model.safetensors, `Gemma4AssistantForCausalLM`) for one tiny target of
tests/fixtures/tiny-gemma, and reference.json: for several positions `p` of the target's
reference input ids, the draft tokens and float32 logits of a drafting round as
`SinglePositionMultiTokenCandidateGenerator` runs it after the target has seen `ids[..p]`:
the assistant's input is the target's scaled embedding of `ids[p]` beside the target's final
hidden state (after its norm) at `p - 1`, then its own projected state; every step at position
`p`, its layers attending over the target's keys and values of positions `0..p` (those of the
last layer of each type that has its own: HF's `shared_kv_states`), on sliding layers the
last `sliding_window` of them (positions `p - window..p`, what the target's ring holds).

The keys and values come from the target's cache after one forward pass over `ids[..p]` (a
`DynamicCache` without a config, so that sliding layers keep every position; HF's own target
returns `shared_kv_states` only where it shares keys between its layers, and none for a target
without KV sharing, which llama.cpp's assistant reads the same way).

transformers 5.23 cannot build an assistant as it defines one: `Gemma4TextConfig.kv_sharing_modes`
looks for a layer of each type with keys of its own before the shared ones, and an assistant
(`num_kv_shared_layers == num_hidden_layers`, which `Gemma4AssistantConfig` requires) has none,
so its `__init__` raises "The set of layer types producing a cache is different than the set of
layer types using them". This script makes every layer of such a config `"reuse"` (attend over
`shared_kv_states[layer_type]`, store nothing), which is what the assistant's forward passes and
what `Gemma4TextAttention` does with it; targets are unaffected.

    make_assistant_fixtures.py new      (writes both fixtures, seed 11 and 12)
    make_assistant_fixtures.py check    (recomputes every reference and compares, 1e-5)
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4TextConfig,
)

_kv_sharing_modes = Gemma4TextConfig.kv_sharing_modes.fget


def _assistant_kv_sharing_modes(config):
    if config.num_kv_shared_layers == config.num_hidden_layers:
        return ["reuse"] * config.num_hidden_layers
    return _kv_sharing_modes(config)


Gemma4TextConfig.kv_sharing_modes = property(_assistant_kv_sharing_modes)

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ROOT / "tests" / "fixtures" / "tiny-gemma"
FIXTURES = ROOT / "tests" / "fixtures" / "tiny-gemma-assistant"
# Positions the target has seen before a drafting round: before, at and past its window of 8.
POSITIONS = [1, 5, 8, 9, 14, 21]
DRAFT_STEPS = 3

# name: (target, ordered embeddings, seed)
FIXTURE_SPECS = {
    # A target with KV-sharing layers and per-layer inputs; the assistant narrower than the
    # target, its lm_head masked to 4 of 16 centroids of 32 tokens.
    "gemma4-e": ("gemma4-e", True, 11),
    # A target without KV sharing, values from keys on its full layers, other KV heads per
    # layer type; the assistant's lm_head over the whole vocabulary.
    "gemma4-dense": ("gemma4-dense", False, 12),
}


def load_target(directory: Path):
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.float32) for k, v in load_file(directory / "model.safetensors").items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"{directory}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def assistant_config(target: dict, ordered: bool) -> dict:
    """A 3-layer assistant (sliding, sliding, full) whose heads read the target's keys."""
    full_layer = target["layer_types"].index("full_attention")
    full = target.get("per_layer_config", {}).get(str(full_layer), {})
    text = dict(target)
    for key in ["architectures", "dtype", "transformers_version"]:
        text.pop(key, None)
    text.update(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        per_layer_config={"2": full} if full else {},
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=False,
    )
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": target["hidden_size"],
        "use_ordered_embeddings": ordered,
        "num_centroids": 16,
        "centroid_intermediate_top_k": 4,
        "tie_word_embeddings": True,
        "text_config": text,
    }


def load_assistant(directory: Path):
    config = Gemma4AssistantConfig.from_pretrained(directory)
    model = Gemma4AssistantForCausalLM(config).to(torch.float32)
    state = load_file(directory / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"{directory}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def producers(config) -> dict:
    """The last layer of each type with keys of its own (HF's "store" layers)."""
    layers = config.num_hidden_layers - (config.num_kv_shared_layers or 0)
    out = {}
    for i in range(layers):
        out[config.layer_types[i]] = i
    return out


@torch.no_grad()
def rounds(target, assistant, input_ids):
    embeddings = target.get_input_embeddings()
    stores = producers(target.config)
    out = []
    for p in POSITIONS:
        ids = torch.tensor([input_ids[:p]])
        cache = DynamicCache()
        hidden = target.model(ids, past_key_values=cache, use_cache=True).last_hidden_state
        # A sliding layer's keys are the last `sliding_window` positions, as a target's
        # sliding-window cache holds them (HF's pipeline passes what the target's cache holds;
        # over more, the assistant's inclusive bidirectional window would admit one more).
        window = target.config.sliding_window
        shared = {
            kind: tuple(t[:, :, -window:] if kind == "sliding_attention" else t for t in (layer.keys, layer.values))
            for kind, layer in ((kind, cache.layers[i]) for kind, i in stores.items())
        }
        last_hidden = hidden[:, -1:]
        token = torch.tensor([[input_ids[p]]])
        tokens, logits = [], []
        for _ in range(DRAFT_STEPS):
            inputs = torch.cat([embeddings(token), last_hidden], dim=-1)
            result = assistant(
                inputs_embeds=inputs,
                position_ids=torch.tensor([[p]]),
                shared_kv_states=shared,
                use_cache=False,
            )
            token = result.logits.argmax(dim=-1)
            last_hidden = result.last_hidden_state
            tokens.append(int(token[0, 0]))
            logits.append(result.logits[0, 0].to(torch.float32))
        out.append({"position": p, "tokens": tokens, "logits": torch.stack(logits)})
    return out


def new(name: str):
    target_name, ordered, seed = FIXTURE_SPECS[name]
    target_dir = TARGETS / target_name
    out = FIXTURES / name
    out.mkdir(parents=True, exist_ok=True)
    config = assistant_config(json.loads((target_dir / "config.json").read_text()), ordered)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(Gemma4AssistantConfig.from_pretrained(out)).to(torch.float32)
    state = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        if key == "masked_embedding.token_ordering":
            state[key] = torch.randperm(tensor.numel(), generator=torch.Generator().manual_seed(seed))
            continue
        if tensor.dim() >= 2:
            value = torch.randn_like(tensor) * 0.02
        else:
            # Gemma 4 multiplies by its norm weights and layer scalars (neutral 1).
            value = 1.0 + 0.2 * torch.randn_like(tensor)
        state[key] = value.contiguous()
    # Centroids far enough apart that the top 4 of 16 are not a near tie.
    if ordered:
        state["masked_embedding.centroids.weight"] = torch.randn_like(state["masked_embedding.centroids.weight"])
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    write_reference(name)


def write_reference(name: str):
    target_name = FIXTURE_SPECS[name][0]
    target = load_target(TARGETS / target_name)
    assistant = load_assistant(FIXTURES / name)
    input_ids = json.loads((TARGETS / target_name / "reference.json").read_text())["input_ids"]
    result = rounds(target, assistant, input_ids)
    reference = {
        "reference": f"HF transformers {__import__('transformers').__version__} Gemma4AssistantForCausalLM, "
        f"float32 on CPU, random weights (seed {FIXTURE_SPECS[name][2]}), the drafting loop of "
        "SinglePositionMultiTokenCandidateGenerator",
        "target": f"tiny-gemma/{target_name}",
        "input_ids": input_ids,
        "rounds": [
            {
                "position": r["position"],
                "tokens": r["tokens"],
                "logits": [[round(float(v), 6) for v in row] for row in r["logits"]],
            }
            for r in result
        ],
    }
    (FIXTURES / name / "reference.json").write_text(json.dumps(reference))
    print(f"{name}: wrote reference.json ({[(r['position'], r['tokens']) for r in result]})")


def check(tolerance: float) -> bool:
    ok = True
    for name, (target_name, _, _) in FIXTURE_SPECS.items():
        committed = json.loads((FIXTURES / name / "reference.json").read_text())
        target = load_target(TARGETS / target_name)
        assistant = load_assistant(FIXTURES / name)
        result = rounds(target, assistant, committed["input_ids"])
        err, same = 0.0, True
        for got, want in zip(result, committed["rounds"]):
            err = max(err, (got["logits"] - torch.tensor(want["logits"])).abs().max().item())
            same &= got["tokens"] == want["tokens"] and got["position"] == want["position"]
        passed = err <= tolerance and same
        ok &= passed
        print(f"{name}: max |logit - committed| {err:.2e}, draft tokens {'equal' if same else 'DIFFER'}: "
              f"{'ok' if passed else 'DIFFERS'}")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("new")
    c = sub.add_parser("check")
    c.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "new":
        for name in FIXTURE_SPECS:
            new(name)
    else:
        sys.exit(0 if check(args.tolerance) else 1)


if __name__ == "__main__":
    main()
