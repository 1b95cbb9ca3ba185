"""The rollout driver: trajectories of turns between the engine and one environment each, tokens in and out.

    reset      env_i = Env(**kwargs) per trajectory; prompt ids of example p = codec.encode_prompt(reset(example))
               (text) or codec.encode_messages(reset(example)) (chat messages)
    stop       sampling.stop + the environment's `stop_strings` (e.g. `</sql>`): a turn ends at one, keeping it
    length     L = min(max_total_tokens, engine.max_model_len); a prompt of L tokens or more is an error; a
               request's max_tokens is cut to its trajectory's room, L − length
    serve      engine.serve(requests, respond) (engines/base.py, "Serving"): the requests of turn 0, then
               respond(finished turns) → the next turns' requests, until none is left
    turn 0     one request per example, n samples: today's call and seeds (sample j of example p: seed + p·n + j),
               trajectory t = p·n + j
    turn k≥1   one request per trajectory, n = 1, seed S_k + t, with S_k = hash(sampling.seed, k): a
               trajectory's samples depend on its own history only, never on which others still run or when
    step       env.step(decoded turn) for every trajectory of the finished batch, concurrently (a thread pool),
               each under `step_timeout_s`
    append     the turn's ids and logprobs exactly as the engine returned them (mask 1), then the observation's
               ids, formatted as the chat template's user/tool turn and tokenized once (`codec.encode_observation`;
               mask 0, logprob 0); the model's text is never re-tokenized

How the turns are batched is the engine's: the default serving runs each wave of requests as one batched
`generate` call (turn k of every trajectory still running, one call; the next wave waits for its slowest
trajectory); vLLM, SGLang and the Ray fleet batch continuously, so a trajectory's next turn joins the running
batch right after the engine step that finished its last one. All give the same trajectories up to the
engine's batch-dependent rounding (each request's seed is its own).

A trajectory's ids are prompt + turn₀ + obs₀ + turn₁ + obs₁ + … + turn_last (no observation after the last
turn), its reward the sum of its steps' rewards. It ends with one finish reason:

    done           the environment said so
    max_turns      its `max_turns`-th turn was not done
    token_budget   the next turn or observation would pass L: a turn that reaches L short of max_tokens without
                   stopping is cut there and not stepped (that turn's reward is 0); an observation that leaves no
                   room for one token of a next turn is not appended, so every prompt is shorter than max_model_len
    env_timeout    an environment step took longer than `step_timeout_s`: reward 0 (the thread is abandoned)
    env_error      an environment step raised, or returned no Step: reward 0

It comes back as one `engines.base.Rollout` whose response is everything after the prompt, with
`response_mask` and `turn_index` (observation tokens belong to the turn they answer); a one-turn trajectory is
the engine's Rollout itself, so a single-turn task's rollouts are exactly today's.

Routed experts (routing replay, `SamplingConfig.return_routed_experts`): turn k's Rollout routes every position of
its input (the trajectory so far) and its response but the last. The trajectory's routing takes each position
from the first turn that computed it, i.e. the turns' routings concatenated in token order,

    routed[p] = routed_k[p]   for the first turn k whose Rollout covers position p

so a turn's sampled tokens carry the routing they were decoded with, and an observation's tokens (and the last
token of the turn before) the routing the next turn's prefill gave them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import time
from typing import Callable, Sequence

import numpy as np

from portable_rl.engines.base import Request, Rollout
from portable_rl.environments import Step, get_environment
from portable_rl.errors import ConfigError, UserError

FINISH_REASONS = ("done", "max_turns", "token_budget", "env_timeout", "env_error")


class EnvironmentPromptError(UserError, ValueError):
    """An environment's reset gave different prompts for the same example (a group must share its prompt), or a
    prompt that leaves no room for a turn."""


def token_limit(config, engine) -> float:
    """L: the most tokens a trajectory may hold, `config.max_total_tokens` and the engine's `max_model_len`
    (inf: neither set). A budget the engine cannot hold is a ConfigError naming the fix (train checks it at
    start)."""
    engine_len = getattr(engine, "max_model_len", None)
    if config.max_total_tokens is not None and engine_len is not None and config.max_total_tokens > engine_len:
        raise ConfigError(f"rl.EnvironmentConfig.max_total_tokens={config.max_total_tokens} but the engine serves "
                          f"at most {engine_len} tokens (max_model_len); raise the engine's max_model_len (gin: "
                          f"MAX_MODEL_LEN = {config.max_total_tokens}) or lower max_total_tokens to {engine_len}")
    return min(config.max_total_tokens or float("inf"), engine_len or float("inf"))


@dataclasses.dataclass
class Trajectory:
    rollout: Rollout      # the whole trajectory (module doc)
    reward: float         # sum of its steps' rewards (0 after env_timeout / env_error)
    num_turns: int        # model turns
    finish: str           # one of FINISH_REASONS
    info: dict            # the last step's info; env_timeout / env_error: {"error": ...}; + "close_error"


def environment_factory(config, reward_fn: Callable[[str, str], float] | None) -> Callable[[], object]:
    """`() -> a new Environment` from an `rl.EnvironmentConfig`. A constructor with a `reward` parameter gets
    `reward_fn` (the task's, `task_reward`) unless `config.kwargs` sets it; one with a `max_turns` parameter (its
    prompts count turns down) gets `config.max_turns`, the one place the limit is set."""
    cls = get_environment(config.name)
    params = inspect.signature(cls).parameters
    kwargs = dict(config.kwargs)
    if "max_turns" in kwargs:
        raise ConfigError(f"rl.EnvironmentConfig.kwargs sets max_turns={kwargs['max_turns']}; set "
                          "rl.EnvironmentConfig.max_turns instead (the driver and the environment share it)")
    if "reward" in params and "reward" not in kwargs:
        kwargs["reward"] = reward_fn
    if "max_turns" in params:
        kwargs["max_turns"] = config.max_turns
    return lambda: cls(**kwargs)


def task_reward(config, task, example) -> Callable[[str, str], float] | None:
    """The task's text reward (`task.reward`, a registered name) when `config`'s environment scores with one (its
    constructor takes `reward` and `config.kwargs` does not set it), else None: a task scored by its environment
    (`task.reward = None`, e.g. `tasks.SqlTask`) has none. Checks the pairing before any model loads: a task
    without a text reward needs such an environment, and `example` (a held-out one) must reset in it."""
    from portable_rl.tasks.rewards import get_reward

    cls = get_environment(config.name)
    needs_reward = "reward" in inspect.signature(cls).parameters and "reward" not in config.kwargs
    name = getattr(task, "name", type(task).__name__)
    if needs_reward and task.reward is None:
        raise ConfigError(f"task {name!r} has no text reward (its environment scores it) but "
                          f"rl.EnvironmentConfig.name = {config.name!r} needs one; compose the task's gin data file "
                          f"(gin/data/sql_generated.gin binds rl.EnvironmentConfig.name = 'sql')")
    reward_fn = get_reward(task.reward) if needs_reward else None
    env = environment_factory(config, reward_fn)()
    try:
        env.reset(example)  # e.g. the SQL environment refuses an example without a database
    finally:
        env.close()
    return reward_fn


def turn_seed(seed: int | None, turn: int) -> int | None:
    """S_k of turn k ≥ 1 (module doc; trajectory t's turn k is seeded S_k + t); None stays unseeded."""
    return None if seed is None else int(np.random.default_rng([seed, turn, 11]).integers(0, 2**31 - 1))


class _Open:
    """A trajectory while it runs: its environment, ids after the prompt, and per response token its logprob,
    mask, turn and support."""

    def __init__(self, env, index: int, example_index: int, prompt_ids):
        self.env, self.index, self.example_index, self.prompt_ids = env, index, example_index, prompt_ids
        self.ids, self.logprobs, self.mask, self.turns, self.support = [], [], [], [], []
        self.reward, self.num_turns, self.finish, self.info, self.last = 0.0, 0, None, {}, None
        self.routed = None  # [positions, S, K]: the turns' routed experts so far (module doc), or None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def append(self, ids, logprobs, mask: int, turn: int, support) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [mask] * len(ids)
        self.turns += [turn] * len(ids)
        self.support += support

    def add_routing(self, routed) -> None:
        """A turn's `Rollout.routed_experts`: the positions no earlier turn covered (module doc)."""
        if routed is not None:
            self.routed = routed if self.routed is None else np.concatenate([self.routed, routed[len(self.routed):]])

    def end(self, finish: str, *, reward: float | None = None, info: dict | None = None) -> None:
        self.finish = finish
        self.reward = self.reward if reward is None else reward
        self.info = self.info if info is None else info

    def trajectory(self, has_support: bool) -> Trajectory:
        single = self.num_turns == 1 and len(self.ids) == len(self.last.response_token_ids)
        # a one-turn trajectory is the engine's Rollout, indexed by its example (a served request's is 0)
        rollout = dataclasses.replace(self.last, prompt_index=self.example_index) if single else Rollout(
            prompt_index=self.example_index, prompt_token_ids=self.prompt_ids,
            response_token_ids=self.ids, response_logprobs=self.logprobs, finish_reason=self.last.finish_reason,
            sampling_support=self.support if has_support else None, response_mask=self.mask, turn_index=self.turns,
            routed_experts=None if self.routed is None else self.routed[:self.length - 1])  # a cut turn: its rows
        return Trajectory(rollout, float(self.reward), self.num_turns, self.finish, self.info)


def _step_all(pool, workers: int, abandoned: list, envs, texts, timeout_s: float) -> list:
    """`env.step(text)` for each pair, concurrently → per pair a Step, or ("env_timeout" | "env_error", message).
    `abandoned`: the futures of timed-out steps (of this call and earlier ones on `pool`), which may hold a worker
    for good; once they hold all `workers`, the steps still waiting for one time out too."""
    started = [None] * len(envs)

    def run(i):
        started[i] = time.perf_counter()
        return envs[i].step(texts[i])

    futures = [pool.submit(run, i) for i in range(len(envs))]
    results, pending = [None] * len(envs), set(range(len(envs)))
    while pending:
        concurrent.futures.wait([futures[i] for i in pending], timeout=0.02,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.perf_counter()
        stuck = sum(not f.done() for f in abandoned) >= workers  # no worker will ever be free again
        for i in sorted(pending):
            if futures[i].done():
                pending.discard(i)
                try:
                    step = futures[i].result()
                    results[i] = Step(step.observation, float(step.reward), bool(step.done), dict(step.info or {}))
                except Exception as e:  # noqa: BLE001  (a raising environment ends its trajectory, not the run)
                    results[i] = ("env_error", f"{type(e).__name__}: {e}")
            elif started[i] is not None and now - started[i] > timeout_s:
                pending.discard(i)
                abandoned.append(futures[i])
                results[i] = ("env_timeout", f"step took longer than step_timeout_s={timeout_s}")
            elif started[i] is None and stuck:
                pending.discard(i)
                futures[i].cancel()
                results[i] = ("env_timeout", "never started: timed-out steps hold every worker")
    return results


def run_trajectories(engine, codec, examples: Sequence, make_env: Callable[[], object], sampling,
                     config) -> tuple[list[Trajectory], float]:
    """Runs `sampling.n` trajectories per example to their end (module doc) → (trajectories, prompt-major:
    trajectory p·n + j is sample j of examples[p]; seconds spent in the environments). `config`: an
    `rl.EnvironmentConfig`."""
    n, budget = sampling.n, token_limit(config, engine)
    env_seconds, start = 0.0, time.perf_counter()
    envs = [make_env() for _ in range(len(examples) * n)]
    prompts = [env.reset(examples[t // n]) for t, env in enumerate(envs)]
    env_seconds += time.perf_counter() - start
    stop = tuple(dict.fromkeys(sampling.stop + tuple(getattr(envs[0], "stop_strings", ()) if envs else ())))
    if stop != sampling.stop:
        sampling = dataclasses.replace(sampling, stop=stop)
    encoded = [codec.encode_prompt(p) if isinstance(p, str) else codec.encode_messages(p) for p in prompts[::n]]
    for t, p in enumerate(prompts):
        if p != prompts[t - t % n]:
            raise EnvironmentPromptError(f"{type(envs[t]).__name__}.reset gave trajectories {t - t % n} and {t} of "
                                         "one example different prompts; reset must depend on the example only")
    for p, ids in enumerate(encoded):
        if len(ids) >= budget:
            raise EnvironmentPromptError(
                f"the prompt of example {p} has {len(ids)} tokens, no room for a turn within {int(budget)} "
                f"(rl.EnvironmentConfig.max_total_tokens / the engine's max_model_len); raise them or drop longer "
                f"prompts from the data")
    trajs = [_Open(env, t, t // n, encoded[t // n]) for t, env in enumerate(envs)]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="environment")
    abandoned = []  # futures of timed-out steps (their threads cannot be stopped)

    def request(key: int, ids: list[int], turn: int, seed: int | None) -> Request:
        room = int(min(sampling.max_tokens, budget - len(ids)))
        return Request(key, ids, dataclasses.replace(sampling, n=sampling.n if turn == 0 else 1, seed=seed,
                                                     max_tokens=room, min_tokens=min(sampling.min_tokens, room)))

    def respond(finished: list[tuple[Request, list]]) -> list[Request]:
        """A batch of finished turns → the next turns' requests: each turn appended and stepped (module doc)."""
        nonlocal env_seconds
        stepping = []
        for req, rollouts in finished:
            for j, r in enumerate(rollouts):  # request `key` holds trajectories key, key + 1, ...
                traj, turn = trajs[req.key + j], trajs[req.key + j].num_turns
                ids, logprobs, support = r.response_token_ids, r.response_logprobs, r.sampling_support or []
                room = int(min(len(ids), budget - traj.length))
                # cut at L, or stopped there short of its own max_tokens (by max_model_len or the cut max_tokens)
                at_limit = room < len(ids) or (r.finish_reason == "length" and traj.length + room == budget
                                               and room < sampling.max_tokens)
                traj.append(ids[:room], logprobs[:room], 1, turn, support[:room])
                traj.num_turns, traj.last = turn + 1, r
                traj.add_routing(r.routed_experts)
                if at_limit:
                    traj.end("token_budget")
                else:
                    stepping.append(traj)
        start = time.perf_counter()
        results = _step_all(pool, config.workers, abandoned, [t.env for t in stepping],
                            [codec.decode_response(t.last.response_token_ids) for t in stepping],
                            config.step_timeout_s)
        env_seconds += time.perf_counter() - start
        following = []
        for traj, result in zip(stepping, results):
            if not isinstance(result, Step):
                traj.end(result[0], reward=0.0, info={"error": result[1]})
                continue
            traj.reward += result.reward
            traj.info = result.info
            if result.done:
                traj.end("done")
                continue
            if traj.num_turns == config.max_turns:
                traj.end("max_turns")
                continue
            closed = bool(traj.last.response_token_ids) and traj.last.response_token_ids[-1] == codec.eos_id
            obs = codec.encode_observation(result.observation or "", config.observation_role, after_eos=closed)
            if traj.length + len(obs) >= budget:  # no room for the observation and one token of a turn
                traj.end("token_budget")
                continue
            traj.append(obs, [0.0] * len(obs), 0, traj.num_turns - 1, [[tok] for tok in obs])
            seed = turn_seed(sampling.seed, traj.num_turns)
            following.append(request(traj.index, traj.prompt_ids + traj.ids, traj.num_turns,
                                     None if seed is None else seed + traj.index))
        return sorted(following, key=lambda r: r.key)

    try:
        engine.serve([request(p * n, ids, 0, sampling.seed_for(p)) for p, ids in enumerate(encoded)], respond)
    finally:
        start = time.perf_counter()
        for traj in trajs:
            try:
                traj.env.close()
            except Exception as e:  # noqa: BLE001  (e.g. an abandoned step still holds it; the trajectory is done)
                traj.info = {**traj.info, "close_error": f"{type(e).__name__}: {e}"}
        env_seconds += time.perf_counter() - start
        pool.shutdown(wait=False, cancel_futures=True)
    return [traj.trajectory(sampling.return_support) for traj in trajs], env_seconds
