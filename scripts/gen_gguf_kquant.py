# Writes a Gemma 3 GGUF whose every matrix (the embedding table too) is one k-quant type (Q4_K,
# Q5_K or Q6_K) of random blocks, for timing the k-quant kernels against the converted Q4/Q8
# forms on one format at a time (llama-quantize's Q4_K_M mixes Q4_K and Q6_K).
#   python3 gen_gguf_kquant.py 1b|4b|12b q4_k|q5_k|q6_k LAYERS VOCAB.json.gz OUT.gguf
# Needs gguf-py (llama.cpp's) and numpy. Blocks are random bytes with small f16 super-block
# scales, so weights stay near the magnitudes of real ones.
import sys, gzip, json, numpy as np, gguf
CFG = {
 "1b":   dict(h=1152, nh=4, nkv=1, hd=256, ffn=6912, win=512, scale=None),
 "4b":   dict(h=2560, nh=8, nkv=4, hd=256, ffn=10240, win=1024, scale=8.0),
 "12b":  dict(h=3840, nh=16, nkv=8, hd=256, ffn=15360, win=1024, scale=8.0),
}
size, kind, layers, vocab_path, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
c = CFG[size]
qt = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q5_k": gguf.GGMLQuantizationType.Q5_K,
      "q6_k": gguf.GGMLQuantizationType.Q6_K}[kind]
block, type_size = gguf.GGML_QUANT_SIZES[qt]
d_at = [type_size - 2] if kind == "q6_k" else [0, 2]
voc = json.load(gzip.open(vocab_path, "rt"))
w = gguf.GGUFWriter(out, "gemma3")
w.add_name(f"gemma3-{size}-{kind}-random")
w.add_context_length(32768); w.add_embedding_length(c["h"]); w.add_block_count(layers)
w.add_feed_forward_length(c["ffn"]); w.add_head_count(c["nh"]); w.add_head_count_kv(c["nkv"])
w.add_key_length(c["hd"]); w.add_value_length(c["hd"]); w.add_layer_norm_rms_eps(1e-6)
w.add_rope_freq_base(1e6); w.add_sliding_window(c["win"])
if c["scale"]:
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR); w.add_rope_scaling_factor(c["scale"])
w.add_tokenizer_model("llama"); w.add_tokenizer_pre("default")
w.add_token_list(voc["tokens"]); w.add_token_scores(voc["scores"]); w.add_token_types(voc["types"])
w.add_bos_token_id(2); w.add_eos_token_id(1); w.add_unk_token_id(3); w.add_pad_token_id(0)
w.add_add_bos_token(True); w.add_add_eos_token(False)
rng = np.random.default_rng(0)
pool = rng.integers(0, 256, size=(1 << 16, type_size), dtype=np.uint8)
for k, at in enumerate(d_at):
    pool[:, at:at + 2] = np.frombuffer(np.float16(1e-4 if k == 0 else 5e-5).tobytes(), dtype=np.uint8)
def mat(rows, cols):
    n = rows * cols // block
    reps = -(-n // pool.shape[0])
    return np.tile(pool, (reps, 1))[:n].reshape(rows, cols // block * type_size)
def norm(n):
    return (1.0 + rng.standard_normal(n, dtype=np.float32) * 0.05).astype(np.float32)
h, hd, nh, nkv, ffn = c["h"], c["hd"], c["nh"], c["nkv"], c["ffn"]
def q(name, rows, cols):
    w.add_tensor(name, mat(rows, cols), raw_dtype=qt)
q("token_embd.weight", len(voc["tokens"]), h)
w.add_tensor("output_norm.weight", norm(h))
for i in range(layers):
    p = f"blk.{i}."
    q(p + "attn_q.weight", nh * hd, h); q(p + "attn_k.weight", nkv * hd, h)
    q(p + "attn_v.weight", nkv * hd, h); q(p + "attn_output.weight", h, nh * hd)
    w.add_tensor(p + "attn_q_norm.weight", norm(hd)); w.add_tensor(p + "attn_k_norm.weight", norm(hd))
    w.add_tensor(p + "attn_norm.weight", norm(h)); w.add_tensor(p + "post_attention_norm.weight", norm(h))
    w.add_tensor(p + "ffn_norm.weight", norm(h)); w.add_tensor(p + "post_ffw_norm.weight", norm(h))
    q(p + "ffn_gate.weight", ffn, h); q(p + "ffn_up.weight", ffn, h)
    q(p + "ffn_down.weight", h, ffn)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print("wrote", out)
