"""Runs the SGLang adapter against the real sglang Engine on a GPU box (the CPU tests use a recording fake).

    pip install "sglang>=0.5.23"  # on the GPU machine
    python scripts/gpu_check_sglang.py [--workdir /tmp/sgl_check]

Checks, each printed as PASS/FAIL, exit status 1 if any fails:
  1. bf16 logprobs equal log_softmax(logits/T) of the same checkpoint in transformers (fp32) within 0.1 nats;
  2. an update outside begin/end_weight_update answers success=False and changes nothing (0.5.23 contract);
  3. after `update_weights` with perturbed weights, generation matches a fresh engine on the saved weights;
  4. fp8_mode="flash_rl": mismatch vs the bf16 reference is > 0 and bounded; pushing the same weights twice
     gives the same logprobs; un-prefixed names are rejected before the engine is touched;
  5. fp8_mode="blockwise" (trainer-side 128x128 FP8 + weight_scale_inv): mismatch > 0 and bounded.
"""

import argparse
import json
import os
import sys
import tempfile

RESULTS = {}


def check(name, ok, detail=""):
    RESULTS[name] = {"ok": bool(ok), "detail": str(detail)}
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def reference_logprobs(hf_model, rollouts, temperature):
    import torch

    out = []
    for r in rollouts:
        ids = torch.tensor([r.prompt_token_ids + r.response_token_ids], device=hf_model.device)
        with torch.no_grad():
            logits = hf_model(ids).logits[0].float()  # [T, V]
        logp = torch.log_softmax(logits / temperature, -1)
        n = len(r.prompt_token_ids)
        targets = torch.tensor(r.response_token_ids, device=logp.device)
        out.append(logp[n - 1: n - 1 + len(targets)].gather(1, targets[:, None])[:, 0].tolist())
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from portable_rl.convert.quantize import write_blockwise_fp8_checkpoint
    from portable_rl.engines import SamplingConfig, create_engine
    from portable_rl.engines.probe import compare_logprobs
    from portable_rl.testing import make_tiny_checkpoint

    import sglang

    print("sglang", sglang.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
    work = args.workdir or tempfile.mkdtemp(prefix="sgl_check_")
    # head_dim 64 and hidden 256: shapes every SGLang attention backend supports.
    ckpt = make_tiny_checkpoint(os.path.join(work, "qwen2"), "qwen2", hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2)
    prompts = [[1, 40, 41, 42], [1, 60, 61, 62, 63, 64], [1, 5]]
    sampling = SamplingConfig(temperature=0.7, max_tokens=16, n=2, seed=3)
    common = dict(engine_init_kwargs=dict(mem_fraction_static=0.3, disable_cuda_graph=True))

    def mismatch(path, rollouts):
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
        ref = reference_logprobs(hf, rollouts, sampling.temperature)
        del hf
        return compare_logprobs([r.response_logprobs for r in rollouts], ref)

    # Perturbed weights, also saved as a checkpoint for the fresh-engine comparison.
    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    new = {n: (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in weights.items()}
    pushed_ckpt = os.path.join(work, "pushed")
    os.makedirs(pushed_ckpt, exist_ok=True)
    for f in os.listdir(ckpt):
        if not f.endswith(".safetensors"):
            os.system(f"cp {os.path.join(ckpt, f)} {pushed_ckpt}/")
    save_file(new, os.path.join(pushed_ckpt, "model.safetensors"), metadata={"format": "pt"})

    # 1-3: bf16
    engine = create_engine("sglang", model_path=ckpt, **common)
    rollouts = engine.generate(prompts, sampling)
    r = mismatch(ckpt, rollouts)
    check("bf16_logprobs_match_reference", r.max_abs_diff < 0.1, r)
    raw = engine._engine
    before = engine.generate(prompts, sampling)
    reply = raw.update_weights_from_tensor(named_tensors=[(n, t.cuda()) for n, t in new.items()])
    after = engine.generate(prompts, sampling)
    check("update_outside_session_fails_and_loads_nothing",
          not reply[0] and [x.response_logprobs for x in after] == [x.response_logprobs for x in before], reply)
    engine.update_weights((n, t.cuda()) for n, t in new.items())
    pushed = engine.generate(prompts, sampling)
    engine.close()
    fresh = create_engine("sglang", model_path=pushed_ckpt, **common)
    from_disk = fresh.generate(prompts, sampling)
    fresh.close()
    same_tokens = [x.response_token_ids for x in pushed] == [x.response_token_ids for x in from_disk]
    max_diff = max(abs(a - b) for x, y in zip(pushed, from_disk)
                   for a, b in zip(x.response_logprobs, y.response_logprobs)) if same_tokens else float("inf")
    check("pushed_equals_fresh_engine", same_tokens and max_diff < 1e-3, f"max |Δ logprob| {max_diff:.2e}")

    # 4: flash_rl
    engine = create_engine("sglang", model_path=ckpt, fp8_mode="flash_rl", **common)
    engine.update_weights((n, t.cuda()) for n, t in weights.items())
    once = engine.generate(prompts, sampling)
    engine.update_weights((n, t.cuda()) for n, t in weights.items())
    twice = engine.generate(prompts, sampling)
    r = mismatch(ckpt, once)
    check("flash_rl_mismatch_bounded", 0 < r.max_abs_diff < 1.0, r)
    check("flash_rl_requantization_deterministic",
          [x.response_logprobs for x in once] == [x.response_logprobs for x in twice])
    try:
        engine.update_weights([("layers.0.mlp.up_proj.weight", weights["model.layers.0.mlp.up_proj.weight"])])
        check("flash_rl_rejects_unprefixed_names", False, "no error")
    except ValueError as e:
        check("flash_rl_rejects_unprefixed_names", True, e)
    engine.close()

    # 5: trainer-side blockwise FP8
    fp8_ckpt = write_blockwise_fp8_checkpoint(ckpt, os.path.join(work, "fp8_blockwise"))
    engine = create_engine("sglang", model_path=fp8_ckpt, fp8_mode="blockwise", **common)
    engine.update_weights((n, t.cuda()) for n, t in weights.items())
    r = mismatch(ckpt, engine.generate(prompts, sampling))
    check("blockwise_fp8_mismatch_bounded", 0 < r.max_abs_diff < 1.0, r)
    engine.close()

    print(json.dumps(RESULTS, indent=2))
    sys.exit(0 if all(v["ok"] for v in RESULTS.values()) else 1)


if __name__ == "__main__":
    main()
