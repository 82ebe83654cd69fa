#!/usr/bin/env python3
"""Tiny Gemma 3 multimodal fixture (SigLIP vision tower + projector + text decoder), from HF
transformers 5.23 (`Gemma3ForConditionalGeneration`).

Pinned versions as scripts/make_fixtures.py (torch==2.15.0, transformers==5.23.0, safetensors;
Pillow for the image processor).

tests/fixtures/tiny-gemma-vision/gemma3 holds config.json, model.safetensors (HF 5.23 names:
`model.vision_tower.vision_model.*`, `model.multi_modal_projector.*`, `model.language_model.*`),
image.png (a 37x23 RGB picture) and reference.json:

- `preprocessed`: `Gemma3ImageProcessorPil` (resize to 56x56, bilinear, rescale, normalize to
  [-1, 1]) of image.png, channel-major;
- `images`: two pixel arrays `[3, 56, 56]` (random, already normalized) and the projected image
  features of each (`get_image_features(...).pooler_output`, `[4, 64]`);
- `prompts`: input ids with one and with two images (each `<start_of_image>`, 4 image soft
  tokens, `<end_of_image>`), the first image past the text model's sliding window (8), with the
  float32 logits of every position (token_type_ids marking the image tokens: each image's tokens
  attend to each other both ways) and 6 greedy tokens (`generate` with the pixel values).

    make_vision_fixtures.py new     (seed 21)
    make_vision_fixtures.py check   (recomputes and compares, 1e-5)
    make_vision_fixtures.py pan-and-scan

`pan-and-scan` writes pan_and_scan.json beside it: HF's pan-and-scan (`Gemma3ImageProcessorPil`
with `do_pan_and_scan`, 56x56 squares, smallest crop 8 pixels, at most 4 crops, from a ratio of
1.2) of wide.png (101x29) and tall.png (23x64), two RGB pictures drawn from seed 22 (written
first): each picture's crop count and its squares (the whole, then the crops) channel-major;
the crop sizes HF's `pan_and_scan` cuts from pictures of other sizes (HF's default rule, and the
rule above); and the prompt text `Gemma3Processor.replace_image_token` makes of each picture.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "fixtures" / "tiny-gemma" / "gemma3"
OUT = ROOT / "tests" / "fixtures" / "tiny-gemma-vision" / "gemma3"
SEED = 21
IMAGE_TOKEN, BOI, EOI = 510, 508, 509
TOKENS_PER_IMAGE = 4
GREEDY_NEW = 6


def config() -> dict:
    text = json.loads((TEXT / "config.json").read_text())
    for key in ["architectures", "dtype", "transformers_version"]:
        text.pop(key, None)
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_channels": 3,
            "image_size": 56,
            "patch_size": 14,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "vision_use_head": False,
        },
        "mm_tokens_per_image": TOKENS_PER_IMAGE,
        "image_token_index": IMAGE_TOKEN,
        "boi_token_index": BOI,
        "eoi_token_index": EOI,
        "tie_word_embeddings": True,
    }


def image_block() -> list:
    return [BOI] + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [EOI]


def prompts() -> list:
    one = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48] + image_block() + [60, 61, 62, 63]
    two = [2, 70, 71] + image_block() + [72, 73, 74, 75, 76] + image_block() + [77, 78]
    return [one, two]


def load_model():
    cfg = Gemma3Config.from_pretrained(OUT)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    missing, unexpected = model.load_state_dict(load_file(OUT / "model.safetensors"), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def processor():
    return Gemma3ImageProcessorPil(
        size={"height": 56, "width": 56}, do_pan_and_scan=False, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )


@torch.no_grad()
def references(model, pixels: torch.Tensor) -> dict:
    features = model.model.get_image_features(pixels).pooler_output
    out = {"images": [], "prompts": []}
    for i in range(pixels.shape[0]):
        out["images"].append({"pixel_values": pixels[i], "features": features[i]})
    for ids in prompts():
        n_images = ids.count(BOI)
        input_ids = torch.tensor([ids])
        token_type_ids = (input_ids == IMAGE_TOKEN).long()
        logits = model(
            input_ids=input_ids, pixel_values=pixels[:n_images], token_type_ids=token_type_ids
        ).logits[0]
        generated = model.generate(
            input_ids=input_ids,
            pixel_values=pixels[:n_images],
            token_type_ids=token_type_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=GREEDY_NEW,
            min_new_tokens=GREEDY_NEW,
            do_sample=False,
            pad_token_id=0,
        )
        out["prompts"].append({"input_ids": ids, "images": n_images, "logits": logits,
                               "greedy_ids": generated[0, len(ids):].tolist()})
    preprocessed = processor()(Image.open(OUT / "image.png"), return_tensors="pt")["pixel_values"][0]
    out["preprocessed"] = preprocessed
    return out


def rounded(t: torch.Tensor):
    return np.round(t.to(torch.float32).numpy(), 6).tolist()


def new():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "config.json").write_text(json.dumps(config(), indent=2))
    torch.manual_seed(SEED)
    model = Gemma3ForConditionalGeneration(Gemma3Config.from_pretrained(OUT)).to(torch.float32)
    text_state = load_file(TEXT / "model.safetensors")
    state = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        text_key = key.replace("model.language_model.", "model.")
        if key.startswith("model.language_model.") and text_key in text_state:
            # The text decoder of tiny-gemma/gemma3, as it is.
            state[key] = text_state[text_key].to(torch.float32).contiguous()
        elif key.endswith("mm_soft_emb_norm.weight"):
            # Gemma's RMSNorm scales by 1 + weight (neutral 0).
            state[key] = (0.2 * torch.randn_like(tensor)).contiguous()
        elif "layer_norm" in key and key.endswith(".weight"):
            state[key] = (1.0 + 0.2 * torch.randn_like(tensor)).contiguous()
        elif key.endswith(".bias"):
            state[key] = (0.05 * torch.randn_like(tensor)).contiguous()
        elif key.endswith("mm_input_projection_weight"):
            state[key] = (0.2 * torch.randn_like(tensor)).contiguous()
        else:
            state[key] = (0.05 * torch.randn_like(tensor)).contiguous()
    missing = [k for k in model.state_dict() if k not in state and k != "lm_head.weight"]
    if missing:
        raise SystemExit(f"not drawn: {missing}")
    save_file(state, OUT / "model.safetensors", metadata={"format": "pt"})
    rng = np.random.default_rng(SEED)
    picture = (rng.random((23, 37, 3)) * 255).astype(np.uint8)
    Image.fromarray(picture, "RGB").save(OUT / "image.png")
    pixels = torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(SEED)) * 2 - 1
    write_reference(pixels)


def write_reference(pixels: torch.Tensor):
    model = load_model()
    r = references(model, pixels)
    reference = {
        "reference": f"HF transformers {__import__('transformers').__version__} Gemma3ForConditionalGeneration, "
        f"float32 on CPU, random vision weights (seed {SEED}), the text decoder of tiny-gemma/gemma3",
        "image_token_index": IMAGE_TOKEN,
        "preprocessed": rounded(r["preprocessed"]),
        "images": [{"pixel_values": rounded(i["pixel_values"]), "features": rounded(i["features"])} for i in r["images"]],
        "prompts": [
            {"input_ids": p["input_ids"], "images": p["images"], "logits": rounded(p["logits"]), "greedy_ids": p["greedy_ids"]}
            for p in r["prompts"]
        ],
    }
    (OUT / "reference.json").write_text(json.dumps(reference))
    print(f"wrote {OUT / 'reference.json'}: greedy {[p['greedy_ids'] for p in r['prompts']]}")


def check(tolerance: float) -> bool:
    committed = json.loads((OUT / "reference.json").read_text())
    pixels = torch.tensor([i["pixel_values"] for i in committed["images"]])
    r = references(load_model(), pixels)
    errs = {
        "preprocessed": (r["preprocessed"] - torch.tensor(committed["preprocessed"])).abs().max().item(),
        "features": max(
            (got["features"] - torch.tensor(want["features"])).abs().max().item()
            for got, want in zip(r["images"], committed["images"])
        ),
        "logits": max(
            (got["logits"] - torch.tensor(want["logits"])).abs().max().item()
            for got, want in zip(r["prompts"], committed["prompts"])
        ),
    }
    same = all(g["greedy_ids"] == w["greedy_ids"] for g, w in zip(r["prompts"], committed["prompts"]))
    ok = all(e <= tolerance for e in errs.values()) and same
    print(f"gemma3 vision: {', '.join(f'{k} {v:.2e}' for k, v in errs.items())}, greedy {'equal' if same else 'DIFFER'}: "
          f"{'ok' if ok else 'DIFFERS'}")
    return ok


def pan_and_scan():
    import types
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    rng = np.random.default_rng(22)
    rule = {"pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 4,
            "pan_and_scan_min_ratio_to_activate": 1.2}
    p = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=True,
                                image_mean=[0.5] * 3, image_std=[0.5] * 3, **rule)
    # `replace_image_token` reads only the processor's `full_image_sequence`.
    soft = "<image_soft_token>" * TOKENS_PER_IMAGE
    ns = types.SimpleNamespace(full_image_sequence=f"\n\n<start_of_image>{soft}<end_of_image>\n\n")
    out = {"rule": rule, "pictures": [], "crop_sizes": []}
    for name, (w, h) in [("wide.png", (101, 29)), ("tall.png", (23, 64))]:
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(OUT / name)
        got = p(Image.open(OUT / name), return_tensors="pt")
        crops = int(got["num_crops"][0])
        text = Gemma3Processor.replace_image_token(ns, {"num_crops": [crops]}, 0)
        out["pictures"].append({"file": name, "num_crops": crops, "squares": rounded(got["pixel_values"]),
                                "text": text})
    default = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
               "pan_and_scan_min_ratio_to_activate": 1.2}
    for which, r in [("default", default), ("small", rule)]:
        for w, h in [(1000, 200), (896, 896), (1100, 1000), (1200, 1000), (300, 1000), (600, 300), (500, 300),
                     (2000, 300), (40, 100), (101, 29), (23, 64), (17, 9), (9, 40)]:
            crops = p.pan_and_scan(np.zeros((3, h, w), dtype=np.uint8), **r)
            out["crop_sizes"].append({"rule": which, "width": w, "height": h,
                                      "crops": [[c.shape[2], c.shape[1]] for c in crops]})
    (OUT / "pan_and_scan.json").write_text(json.dumps(out))
    print(f"wrote {OUT / 'pan_and_scan.json'}: " + ", ".join(f"{x['file']} {x['num_crops']} crops" for x in out["pictures"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("new")
    sub.add_parser("pan-and-scan")
    c = sub.add_parser("check")
    c.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "new":
        new()
    elif args.command == "pan-and-scan":
        pan_and_scan()
    else:
        sys.exit(0 if check(args.tolerance) else 1)


if __name__ == "__main__":
    main()
