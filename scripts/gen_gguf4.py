# Writes a Gemma 4 GGUF (`gemma4` architecture, quantized blocks written directly, random weights,
# the real Gemma 3 vocabulary as a SentencePiece `llama` tokenizer) of a published text shape, for
# speed tests: llama.cpp and burn-gemma read the same file. Metadata and tensor names as
# llama.cpp's converter writes them (conversion/gemma.py, Gemma4Model). The `g3-` shapes are
# Gemma 3 (`gemma3` architecture, Gemma3Model's names), written the same way: a 27B file without
# the 54 GB F16 file that llama-quantize would start from.
#   python3 gen_gguf4.py e2b|e4b|31b|tiny-31b|26b-a4b|g3-1b|g3-4b|g3-12b|g3-27b VOCAB.json.gz OUT.gguf [q8_0|q4_k_m|bf16]
# q4_k_m gives each matrix the type llama-quantize's Q4_K_M gives it (src/llama-quant.cpp; the
# E2B file's 541 types checked against it): Q6_K for the tied embedding tables, for attn_v and
# ffn_down on the layers its `use_more_bits` picks, Q8_0 for the per-layer projection, Q4_K for
# the rest; it writes a 31B file in about a minute where requantizing the Q8_0 one takes minutes.
# bf16 writes every matrix as BF16 values about N(0, 0.02), the type of the published checkpoints.
# Needs the pure-Python `gguf` package (llama.cpp's gguf-py) and numpy.
import sys, gzip, json, numpy as np, gguf

# layers, hidden, intermediate, heads, KV heads (sliding, full), values from keys, window,
# sliding pattern, KV-sharing layers, double-wide MLPs, per-layer input width; mixture of experts:
# (experts, used per token, expert intermediate size) beside the dense MLP.
CFG = {
    "e2b": dict(L=35, h=1536, ffn=6144, nh=8, kv=1, kv_full=1, k_eq_v=False, win=512, pattern=5, shared=20, wide=True, ple=256),
    "e4b": dict(L=42, h=2560, ffn=10240, nh=8, kv=2, kv_full=2, k_eq_v=False, win=512, pattern=6, shared=18, wide=False, ple=256),
    # A small file of the same layout, to check the script and the loaders.
    "tiny": dict(L=6, h=64, ffn=128, nh=2, kv=1, kv_full=1, k_eq_v=True, win=8, pattern=3, shared=2, wide=True, ple=32),
    # 31B's layout (values from keys on the full layers, 4 full-layer KV heads) in a small file.
    "tiny-31b": dict(L=6, h=64, ffn=128, nh=4, kv=2, kv_full=2, k_eq_v=True, win=8, pattern=6, shared=0, wide=False, ple=0),
    "31b": dict(L=60, h=5376, ffn=21504, nh=32, kv=16, kv_full=4, k_eq_v=True, win=1024, pattern=6, shared=0, wide=False, ple=0),
    # 26B-A4B: 30 layers (25 sliding + 5 full), 128 experts, top 8, expert width 704 beside a dense
    # MLP of 2112 (shapes from the published model, see the design notes; 25.1 B parameters).
    "26b-a4b": dict(L=30, h=2816, ffn=2112, nh=16, kv=8, kv_full=2, k_eq_v=True, win=1024, pattern=6, shared=0, wide=False, ple=0,
                    moe=(128, 8, 704)),
    # A small file of the expert layout, to check the script and the loaders.
    "tiny-moe": dict(L=4, h=64, ffn=96, nh=2, kv=1, kv_full=1, k_eq_v=True, win=8, pattern=2, shared=0, wide=False, ple=0,
                     moe=(4, 2, 32)),
}
HD, HD_FULL, PARTIAL = 256, 512, 0.25
# Gemma 3: layers, hidden, intermediate, heads, KV heads, head width, window, linear RoPE scale of
# the full-attention layers (the published config.json values).
CFG3 = {
    "g3-1b": dict(L=26, h=1152, ffn=6912, nh=4, kv=1, hd=256, win=512, scale=None),
    "g3-4b": dict(L=34, h=2560, ffn=10240, nh=8, kv=4, hd=256, win=1024, scale=8.0),
    "g3-12b": dict(L=48, h=3840, ffn=15360, nh=16, kv=8, hd=256, win=1024, scale=8.0),
    "g3-27b": dict(L=62, h=5376, ffn=21504, nh=32, kv=16, hd=128, win=1024, scale=8.0),
}

size, vocab_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
quant = sys.argv[4] if len(sys.argv) > 4 else "q8_0"
assert quant in ("q8_0", "q4_k_m", "bf16"), f"unknown quantization {quant}"
gemma3 = size in CFG3
c = CFG3[size] if gemma3 else CFG[size]
voc = json.load(gzip.open(vocab_path, "rt"))
V = len(voc["tokens"])
L, h, nh = c["L"], c["h"], c["nh"]

def tokenizer(w):
    w.add_tokenizer_model("llama"); w.add_tokenizer_pre("default")
    w.add_token_list(voc["tokens"]); w.add_token_scores(voc["scores"]); w.add_token_types(voc["types"])
    w.add_bos_token_id(2); w.add_eos_token_id(1); w.add_unk_token_id(3); w.add_pad_token_id(0)
    w.add_add_bos_token(True); w.add_add_eos_token(False)

if gemma3:
    w = gguf.GGUFWriter(out, "gemma3")
    w.add_name(f"gemma3-{size[3:]}-random")
    w.add_context_length(131072); w.add_embedding_length(h); w.add_block_count(L)
    w.add_feed_forward_length(c["ffn"]); w.add_head_count(nh); w.add_head_count_kv(c["kv"])
    w.add_key_length(c["hd"]); w.add_value_length(c["hd"]); w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6); w.add_sliding_window(c["win"])
    if c["scale"]:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR); w.add_rope_scaling_factor(c["scale"])
    tokenizer(w)
else:
    swa = [(i + 1) % c["pattern"] != 0 for i in range(L)]
    first_shared = L - c["shared"]
    ffn = [c["ffn"] * (2 if c["wide"] and i >= first_shared else 1) for i in range(L)]
    w = gguf.GGUFWriter(out, "gemma4")
    w.add_name(f"gemma4-{size}-random")
    a = lambda k: f"gemma4.{k}"
    w.add_uint32(a("context_length"), 131072)
    w.add_uint32(a("embedding_length"), h)
    w.add_uint32(a("block_count"), L)
    w.add_array(a("feed_forward_length"), ffn) if c["wide"] else w.add_uint32(a("feed_forward_length"), c["ffn"])
    w.add_uint32(a("attention.head_count"), nh)
    w.add_array(a("attention.head_count_kv"), [c["kv"] if s else c["kv_full"] for s in swa])
    w.add_uint32(a("attention.key_length"), HD_FULL)
    w.add_uint32(a("attention.value_length"), HD_FULL)
    w.add_uint32(a("attention.key_length_swa"), HD)
    w.add_uint32(a("attention.value_length_swa"), HD)
    w.add_float32(a("attention.layer_norm_rms_epsilon"), 1e-6)
    w.add_uint32(a("attention.sliding_window"), c["win"])
    w.add_array(a("attention.sliding_window_pattern"), swa)
    w.add_uint32(a("attention.shared_kv_layers"), c["shared"])
    w.add_uint32(a("embedding_length_per_layer_input"), c["ple"])
    w.add_float32(a("rope.freq_base"), 1e6)
    w.add_float32(a("rope.freq_base_swa"), 1e4)
    w.add_uint32(a("rope.dimension_count"), HD_FULL)
    w.add_uint32(a("rope.dimension_count_swa"), HD)
    w.add_float32(a("final_logit_softcapping"), 30.0)
    if "moe" in c:
        experts, used, expert_ffn = c["moe"]
        w.add_uint32(a("expert_count"), experts)
        w.add_uint32(a("expert_used_count"), used)
        w.add_uint32(a("expert_feed_forward_length"), expert_ffn)
    tokenizer(w)

# The file type llama.cpp names the file by (a label; each tensor carries its own type).
w.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[quant])

rng = np.random.default_rng(0)
# A pool of Q8_0 blocks (f16 scale, 32 int8 codes: values about N(0, 0.02)), tiled over each matrix.
POOL = 1 << 20
scales = np.full((POOL, 1), 0.06 / 127, dtype=np.float16).view(np.uint8).reshape(POOL, 2)
codes = np.clip(np.round(rng.standard_normal((POOL, 32)) * 127 / 3), -127, 127).astype(np.int8).view(np.uint8)
pool = np.concatenate([scales, codes], axis=1).reshape(-1)  # 34 bytes per block

def q8(rows, cols):
    blocks = rows * cols // 32
    reps = -(-blocks // POOL)
    return np.tile(pool, reps)[: blocks * 34].reshape(rows, cols // 32 * 34)

# Pools of random k-quant super-blocks (256 weights): random codes and sub-block scales, small f16
# super-block scales (Q4_K: d and dmin first; Q6_K: d last), so weights stay near real magnitudes.
Q4K, Q6K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
def kpool(qt, scale_at):
    size = gguf.GGML_QUANT_SIZES[qt][1]
    p = rng.integers(0, 256, size=(1 << 16, size), dtype=np.uint8)
    for at, d in scale_at:
        p[:, at:at + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    return p
Q5_0 = gguf.GGMLQuantizationType.Q5_0
kpools = {Q4K: kpool(Q4K, [(0, 1e-4), (2, 5e-5)]), Q6K: kpool(Q6K, [(gguf.GGML_QUANT_SIZES[Q6K][1] - 2, 1e-4)]),
          Q5_0: kpool(Q5_0, [(0, 4e-3)])}

def kq(qt, rows, cols):
    p = kpools[qt]
    per_block = gguf.GGML_QUANT_SIZES[qt][0]
    n = rows * cols // per_block
    return np.tile(p, (-(-n // p.shape[0]), 1))[:n].reshape(rows, cols // per_block * p.shape[1])

# llama-quantize's Q4_K_M choice of more bits: the first and last eighth of the layers and every
# third between (indices over the tensors of that role, as it counts them).
more_bits = lambda i, n: i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

# A pool of BF16 values (the high halves of f32 values about N(0, 0.02)), tiled over each matrix.
# Its odd length keeps rows from repeating (with 2^20 values, every 4,096th embedding row of a
# 5,376-wide model was the same, so logits tied in groups: the 2026-11-30 files).
BF16_POOL = POOL + 7
bf16_pool = ((rng.standard_normal(BF16_POOL).astype(np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)

def bf16(rows, cols):
    n = rows * cols
    return np.tile(bf16_pool, -(-n // BF16_POOL))[:n].view(np.uint8).reshape(rows, cols * 2)

def mat(name, rows, cols, six=False):
    if quant == "bf16":
        w.add_tensor(name, bf16(rows, cols), raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif quant == "q8_0":
        w.add_tensor(name, q8(rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        qt = Q6K if six else Q4K
        if cols % 256:
            # Rows that are not whole super-blocks (Gemma 3 1B's 1,152): llama-quantize's
            # fallbacks, Q8_0 for Q6_K and Q5_0 for Q4_K.
            if six:
                w.add_tensor(name, q8(rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                return
            qt = Q5_0
        w.add_tensor(name, kq(qt, rows, cols), raw_dtype=qt)

def experts_mat(name, experts, rows, cols):
    assert quant == "q8_0", "expert tensors are written as Q8_0 only"
    w.add_tensor(name, q8(experts * rows, cols).reshape(experts, rows, cols // 32 * 34), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

def norm(name, n):
    w.add_tensor(name, (1.0 + rng.standard_normal(n) * 0.05).astype(np.float32))

mat("token_embd.weight", V, h, six=True)
norm("output_norm.weight", h)
if gemma3:
    hd, kv = c["hd"], c["kv"]
    for i in range(L):
        p = f"blk.{i}."
        mat(p + "attn_q.weight", nh * hd, h); mat(p + "attn_k.weight", kv * hd, h)
        mat(p + "attn_v.weight", kv * hd, h, six=more_bits(i, L)); mat(p + "attn_output.weight", h, nh * hd)
        norm(p + "attn_q_norm.weight", hd); norm(p + "attn_k_norm.weight", hd)
        for n in ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"]:
            norm(p + n + ".weight", h)
        mat(p + "ffn_gate.weight", c["ffn"], h); mat(p + "ffn_up.weight", c["ffn"], h)
        mat(p + "ffn_down.weight", h, c["ffn"], six=more_bits(i, L))
else:
    rotated = int(PARTIAL * HD_FULL / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (HD_FULL // 2 - rotated), dtype=np.float32))
    if c["ple"]:
        mat("per_layer_token_embd.weight", V, L * c["ple"], six=True)
        # llama-quantize keeps this projection in Q8_0 for every type.
        w.add_tensor("per_layer_model_proj.weight", q8(L * c["ple"], h), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        norm("per_layer_proj_norm.weight", c["ple"])
    has_v = [i < first_shared and (swa[i] or not c["k_eq_v"]) for i in range(L)]
    n_v = sum(has_v)
    for i in range(L):
        p = f"blk.{i}."
        hd, kv = (HD, c["kv"]) if swa[i] else (HD_FULL, c["kv_full"])
        mat(p + "attn_q.weight", nh * hd, h)
        norm(p + "attn_q_norm.weight", hd)
        if i < first_shared:
            mat(p + "attn_k.weight", kv * hd, h)
            norm(p + "attn_k_norm.weight", hd)
            if has_v[i]:
                mat(p + "attn_v.weight", kv * hd, h, six=more_bits(sum(has_v[:i]), n_v))
        mat(p + "attn_output.weight", h, nh * hd)
        for n in ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"]:
            norm(p + n + ".weight", h)
        mat(p + "ffn_gate.weight", ffn[i], h); mat(p + "ffn_up.weight", ffn[i], h); mat(p + "ffn_down.weight", h, ffn[i], six=more_bits(i, L))
        w.add_tensor(p + "layer_output_scale.weight", np.array([0.5], dtype=np.float32))
        if "moe" in c:
            # The router (f32, as the converter keeps small tensors), its input scale and the
            # per-expert output scale; gate and up stacked per expert as HF's `gate_up_proj`.
            w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((experts, h)) * 0.02).astype(np.float32))
            w.add_tensor(p + "ffn_gate_inp.scale", (1.0 + rng.standard_normal(h) * 0.05).astype(np.float32))
            w.add_tensor(p + "ffn_down_exps.scale", (1.0 + rng.standard_normal(experts) * 0.05).astype(np.float32))
            experts_mat(p + "ffn_gate_up_exps.weight", experts, 2 * expert_ffn, h)
            experts_mat(p + "ffn_down_exps.weight", experts, h, expert_ffn)
            for n in ["pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"]:
                norm(p + n + ".weight", h)
        if c["ple"]:
            mat(p + "inp_gate.weight", c["ple"], h); mat(p + "proj.weight", h, c["ple"]); norm(p + "post_norm.weight", h)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print("wrote", out)
