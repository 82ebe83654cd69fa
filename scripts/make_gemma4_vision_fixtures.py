#!/usr/bin/env python3
"""Tiny Gemma 4 multimodal fixtures (vision tower + embedder beside the tiny `gemma4-dense` and
`gemma4-e` text decoders), from HF transformers 5.23 (`Gemma4ForConditionalGeneration`).

Pinned versions as scripts/make_fixtures.py (torch==2.15.0, transformers==5.23.0, safetensors).

tests/fixtures/tiny-gemma-vision/gemma4 (text decoder gemma4-dense) and gemma4-e (gemma4-e:
per-layer inputs, KV sharing) each hold config.json (a `gemma4` config: the text config of
tests/fixtures/tiny-gemma/<text>, with `use_bidirectional_attention: "vision"`, and a small
`vision_config` with clipped linears and standardization on, one KV head for two query heads,
4x4 patches pooled 2x2), model.safetensors (HF 5.23 names: `model.vision_tower.*`,
`model.embed_vision.*`, and the text decoder's weights under `model.language_model.*`, values as
in the text fixture; the vision weights the same in both) and reference.json:

- `images`: patch grids of 4 x 6 and 2 x 2 patches (`patches`: `[rows * cols, 4 * 4 * 3]`
  values in [0, 1], each patch's pixels row by row with a pixel's channels together, as
  `convert_image_to_patches` lays them out), with `get_image_features(...).pooler_output`
  (`[rows / 2 * cols / 2, 64]`) of each image alone;
- `batched`: both images in one padded batch (HF's own padding, (-1, -1) positions): the same
  features, checked here;
- `preprocessed` (gemma4 only): `Gemma4ImageProcessorPil` (4x4 patches pooled 2x2, at most 70
  soft tokens: resized keeping the aspect ratio, bicubic, rescaled to [0, 1]) of
  tests/fixtures/tiny-gemma-vision/gemma3/image.png (37x23), its patch grid and patches;
- `prompts`: input ids with one image (its soft tokens past the sliding window of 8) and with
  both (each `<|image>`, the image's soft tokens, `<image|>`), with the float32 logits of every
  position (`mm_token_type_ids` marking the soft tokens: they attend to each other both ways on
  the sliding layers).

    make_gemma4_vision_fixtures.py new     (seed 22)
    make_gemma4_vision_fixtures.py check   (recomputes and compares, 1e-5)
    make_gemma4_vision_fixtures.py greedy  (writes greedy.json beside reference.json: for each of
                                            its prompts, the model's greedy continuation of
                                            GREEDY_TOKENS tokens with the stored patches, each
                                            step a full forward pass, and the smallest gap
                                            between the top two logits on the way)
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from PIL import Image
from transformers import Gemma4Config, Gemma4ForConditionalGeneration
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent
# Fixture folder -> the text fixture it extends.
VARIANTS = {"gemma4": "gemma4-dense", "gemma4-e": "gemma4-e"}
TEXT = OUT = None
SEED = 22
PATCH, POOL = 4, 2
GRIDS = [(4, 6), (2, 2)]
IMAGE, BOI, EOI = 500, 501, 502


def use(variant: str):
    global TEXT, OUT
    TEXT = ROOT / "tests" / "fixtures" / "tiny-gemma" / VARIANTS[variant]
    OUT = ROOT / "tests" / "fixtures" / "tiny-gemma-vision" / variant


def block(tokens: int) -> list:
    return [BOI] + [IMAGE] * tokens + [EOI]


def prompts() -> list:
    tokens = [r * c // POOL**2 for r, c in GRIDS]
    one = [2] + list(range(10, 20)) + block(tokens[0]) + [30, 31, 32]
    two = [2, 40, 41] + block(tokens[0]) + [42, 43, 44] + block(tokens[1]) + [45, 46]
    return [(one, 1), (two, 2)]


def config() -> dict:
    text = json.loads((TEXT / "config.json").read_text())
    for key in ["architectures", "dtype", "transformers_version"]:
        text.pop(key, None)
    text["use_bidirectional_attention"] = "vision"
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
            "pooling_kernel_size": POOL,
            "patch_size": PATCH,
            "position_embedding_size": 16,
            "use_clipped_linears": True,
            "standardize": True,
        },
        "audio_config": None,
        "image_token_id": IMAGE,
        "boi_token_id": BOI,
        "eoi_token_id": EOI,
        "tie_word_embeddings": True,
    }


def positions(rows: int, cols: int) -> torch.Tensor:
    x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    return torch.tensor(np.stack([x, y], axis=-1).reshape(rows * cols, 2))


def load_model():
    model = Gemma4ForConditionalGeneration(Gemma4Config.from_pretrained(OUT)).to(torch.float32)
    missing, unexpected = model.load_state_dict(load_file(OUT / "model.safetensors"), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def references(model, patches: list) -> dict:
    out = {"images": []}
    for (rows, cols), values in zip(GRIDS, patches):
        features = model.model.get_image_features(values[None], positions(rows, cols)[None]).pooler_output[0]
        out["images"].append({"rows": rows, "cols": cols, "patches": values, "features": features})
    # Both images in one batch, padded as the image processor pads: the same features.
    longest = max(r * c for r, c in GRIDS)
    values = torch.zeros(len(GRIDS), longest, 3 * PATCH * PATCH)
    ids = torch.full((len(GRIDS), longest, 2), -1, dtype=torch.long)
    for i, ((rows, cols), v) in enumerate(zip(GRIDS, patches)):
        values[i, : rows * cols] = v
        ids[i, : rows * cols] = positions(rows, cols)
    batched = model.model.get_image_features(values, ids).pooler_output
    for image, got in zip(out["images"], batched):
        err = (image["features"] - got).abs().max().item()
        if err > 1e-5:
            raise SystemExit(f"padded batch differs from single images by {err}")
    out["batched_max_difference"] = max(
        (image["features"] - got).abs().max().item() for image, got in zip(out["images"], batched)
    )
    out["prompts"] = []
    for ids, n_images in prompts():
        input_ids = torch.tensor([ids])
        logits = model(
            input_ids=input_ids,
            pixel_values=values[:n_images],
            image_position_ids=ids_of(n_images, longest),
            mm_token_type_ids=(input_ids == IMAGE).long(),
        ).logits[0]
        out["prompts"].append({"input_ids": ids, "images": n_images, "logits": logits})
    return out


def ids_of(n_images: int, longest: int) -> torch.Tensor:
    ids = torch.full((n_images, longest, 2), -1, dtype=torch.long)
    for i, (rows, cols) in enumerate(GRIDS[:n_images]):
        ids[i, : rows * cols] = positions(rows, cols)
    return ids


def rounded(t: torch.Tensor):
    return np.round(t.to(torch.float32).numpy(), 7).tolist()


def preprocessed() -> dict:
    processor = Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=70)
    out = processor(Image.open(ROOT / "tests" / "fixtures" / "tiny-gemma-vision" / "gemma3" / "image.png"))
    positions_ = np.asarray(out["image_position_ids"][0])
    real = (positions_ != -1).all(axis=-1)
    cols, rows = positions_[real].max(axis=0) + 1
    patches = np.asarray(out["pixel_values"][0])[real]
    return {"rows": int(rows), "cols": int(cols), "patches": np.round(patches, 7).tolist()}


def as_json(refs: dict) -> dict:
    extra = {"preprocessed": preprocessed()} if OUT.name == "gemma4" else {}
    return extra | {
        "patch_size": PATCH,
        "pooling_kernel_size": POOL,
        "batched_max_difference": refs["batched_max_difference"],
        "images": [
            {"rows": i["rows"], "cols": i["cols"], "patches": rounded(i["patches"]), "features": rounded(i["features"])}
            for i in refs["images"]
        ],
        "prompts": [
            {"input_ids": p["input_ids"], "images": p["images"], "logits": rounded(p["logits"])}
            for p in refs["prompts"]
        ],
    }


def new():
    for variant in VARIANTS:
        use(variant)
        new_variant()


def new_variant():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "config.json").write_text(json.dumps(config(), indent=2))
    torch.manual_seed(SEED)
    model = Gemma4ForConditionalGeneration(Gemma4Config.from_pretrained(OUT)).to(torch.float32)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    # The text decoder's weights as the tiny gemma4-dense fixture holds them.
    for name, value in load_file(TEXT / "model.safetensors").items():
        state["model.language_model." + name.removeprefix("model.")] = value
    # Every vision weight random (HF initializes norms to 1 and some tables to constants), the
    # clipping bounds finite and tight enough to clamp, the standardization away from identity.
    for name in list(state):
        if not (name.startswith("model.vision_tower.") or name.startswith("model.embed_vision.")):
            continue
        v = state[name]
        if name.endswith("input_min") or name.endswith("output_min"):
            state[name] = torch.tensor(-1.0 - torch.rand(()).item())
        elif name.endswith("input_max") or name.endswith("output_max"):
            state[name] = torch.tensor(1.0 + torch.rand(()).item())
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("std_scale"):
            state[name] = 1.0 + 0.2 * torch.randn_like(v)
        elif name.endswith("std_bias"):
            state[name] = 0.5 * torch.randn_like(v)
        else:
            state[name] = 0.2 * torch.randn_like(v)
    save_file({k: v.contiguous() for k, v in state.items()}, OUT / "model.safetensors")
    # Rounded as stored, so that the stored features are those of the stored patches.
    patches = [torch.tensor(rounded(torch.rand(r * c, 3 * PATCH * PATCH))) for r, c in GRIDS]
    refs = references(load_model(), patches)
    (OUT / "reference.json").write_text(json.dumps(as_json(refs)))
    print(f"wrote {OUT}; padded batch within {refs['batched_max_difference']:.2e} of single images")


GREEDY_TOKENS = 8


@torch.no_grad()
def greedy():
    for variant in VARIANTS:
        use(variant)
        model = load_model()
        want = json.loads((OUT / "reference.json").read_text())
        patches = [torch.tensor(i["patches"], dtype=torch.float32) for i in want["images"]]
        longest = max(r * c for r, c in GRIDS)
        values = torch.zeros(len(GRIDS), longest, 3 * PATCH * PATCH)
        for i, ((rows, cols), v) in enumerate(zip(GRIDS, patches)):
            values[i, : rows * cols] = v
        out = []
        for prompt in want["prompts"]:
            ids, n_images = list(prompt["input_ids"]), prompt["images"]
            new, gap = [], float("inf")
            for _ in range(GREEDY_TOKENS):
                input_ids = torch.tensor([ids + new])
                logits = model(
                    input_ids=input_ids,
                    pixel_values=values[:n_images],
                    image_position_ids=ids_of(n_images, longest),
                    mm_token_type_ids=(input_ids == IMAGE).long(),
                ).logits[0, -1]
                top = torch.topk(logits, 2).values
                gap = min(gap, (top[0] - top[1]).item())
                new.append(int(logits.argmax()))
            out.append({"input_ids": ids, "images": n_images, "greedy_ids": new, "smallest_top2_gap": gap})
            print(f"{variant}: {n_images} images -> {new} (top-2 gap at least {gap:.2e})")
        (OUT / "greedy.json").write_text(json.dumps({"prompts": out}, indent=1))


def check():
    failed = False
    for variant in VARIANTS:
        use(variant)
        want = json.loads((OUT / "reference.json").read_text())
        patches = [torch.tensor(i["patches"], dtype=torch.float32) for i in want["images"]]
        got = as_json(references(load_model(), patches))
        pairs = [(g["features"], w["features"]) for g, w in zip(got["images"], want["images"])]
        pairs += [(g["logits"], w["logits"]) for g, w in zip(got["prompts"], want["prompts"])]
        worst = max(np.abs(np.array(g) - np.array(w)).max() for g, w in pairs)
        print(f"{variant}: features and logits within {worst:.2e} of the stored ones")
        failed |= worst > 1e-5
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["new", "check", "greedy"])
    {"new": new, "check": check, "greedy": greedy}[parser.parse_args().mode]()
