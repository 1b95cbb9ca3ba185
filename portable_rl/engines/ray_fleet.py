"""A fleet of rollout engines on Ray: N actors, each holding any registered adapter, behind one `EngineAdapter`.

    fleet = create_engine("ray_fleet", engine="vllm", engine_kwargs={...}, model_path=ckpt,
                          num_engines=2, resources_per_engine={"num_gpus": 1}, address=None)

Each engine is a Ray actor (`EngineHost`) that builds its adapter with `registry.create_engine(engine, ...)`,
so in-tree and out-of-tree adapters work alike. The driver (the trainer) never imports vLLM.

Rollouts. `generate` splits the batch into contiguous shards, one per engine, and concatenates the results
in prompt-major order with global `prompt_index`. Seeds: adapters give prompt i of a batch the seeds
`SamplingConfig.seed_for(i, j)` = `seed + i*n + j`, so shard k, starting at prompt s_k, is sent
`seed_for(s_k)` = `seed + s_k*n`: every
prompt gets the seeds it would get from one engine holding the whole batch, and the fleet's output does
not depend on the number of engines (up to batch-composition effects on the logits; measured equal in
tests/test_engines_ray.py). The `SamplingConfig` travels whole (stop strings included), and `max_model_len` is
engine 0's, so the multi-turn driver runs on a fleet as on one engine.

Serving (base.py, "Serving"). `serving` splits the first requests into contiguous shards, as `generate` does,
and opens one serving session per engine actor (`EngineHost.serve_start`: the actor keeps its adapter's
`serving` generator between calls). Whichever actor answers first, its finished requests are yielded; the
requests that follow them go back to that same actor (`serve_reply`), so a trajectory stays on one engine and
its next turn reuses the prefix cached there. Each actor batches as its adapter does (vLLM: continuously), and
no actor waits for another. The requests travel with a serial number, so the caller gets its own `Request`
objects back.

Weights. `update_weights` packs each bucket ONCE into the object store (every tensor made contiguous and
stored as raw bytes, which Ray keeps as a zero-copy numpy buffer in shared memory), then every actor reads
the same refs — on one node all actors map the same bytes — and makes its adapter's single
`update_weights` call. The refs of the last push stay in the store: they are how a restarted engine gets
the current weights back.

Faults. If an actor dies (process killed, node lost) during `generate`, `update_weights`, `sleep` or
`wake_up`, the fleet starts a replacement on the same checkpoint, re-pushes the last pushed weights, and
retries that engine's share; the call returns normally. During `serving`, the replacement is sent every
request that actor had not answered (each carries its seed, so it gives the same rollouts). `restarts` counts
replacements.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from typing import Any, Generator, Iterable, Sequence

from portable_rl.engines.buckets import bucketed
from portable_rl.engines.base import (EngineAdapter, Finished, NamedTensor, Request, Rollout, SamplingConfig,
                                      check_prompts, named_tensor_pairs, prompt_seeds)
from portable_rl.engines.registry import create_engine, register
from portable_rl.errors import UserError

DEFAULT_BUCKET_BYTES = 256 << 20
# The engine runs inside the actor's own process: the in-process vLLM engine there (no extra engine-core
# process), so weights read from the object store reach the worker by reference.
ACTOR_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def shard_bounds(num_prompts: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, sizes differing by at most one; no empty shards."""
    base, extra = divmod(num_prompts, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        end = start + base + (k < extra)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


def shard_sampling(sampling: SamplingConfig, start: int) -> SamplingConfig:
    """The sampling config for a shard starting at global prompt `start` (seed offset start·n)."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed_for(start))


def pack_bucket(pairs) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """(name, tensor) pairs → (name, dtype, shape, uint8 numpy bytes); a non-contiguous view is copied once."""
    import torch

    packed = []
    for name, tensor in pairs:
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # [numel · itemsize], shares memory with t
        packed.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), raw))
    return packed


def unpack_bucket(packed) -> list[tuple[str, Any]]:
    """Inverse of `pack_bucket`, zero-copy: tensors view the (read-only) object-store buffers."""
    import torch

    pairs = []
    with warnings.catch_warnings():  # "non-writable array": the engine's weight loaders only read them
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, shape, raw in packed:
            pairs.append((name, torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)))
    return pairs


class FleetStartTimeoutError(UserError, TimeoutError):
    """The cluster could not place the engine actors in time (a user error: too few resources)."""


class EngineHost:
    """The Ray actor: one adapter in its own process. Methods mirror `EngineAdapter`."""

    def __init__(self, engine: str, engine_kwargs: dict[str, Any], env: dict[str, str]):
        os.environ.update(env)  # before the adapter imports its engine
        self.engine = create_engine(engine, **engine_kwargs)

    def pid(self) -> int:
        return os.getpid()

    def quantization(self) -> str | None:
        return self.engine.quantization

    def returns_sampling_support(self) -> bool:
        return bool(getattr(self.engine, "returns_sampling_support", False))

    def max_model_len(self) -> int | None:
        return getattr(self.engine, "max_model_len", None)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int] | None = None
                 ) -> list[Rollout]:
        return self.engine.generate(prompts, sampling, seeds=seeds)

    # A serving session (module doc, "Serving"): the adapter's `serving` generator, kept between calls. Requests
    # come numbered, [(serial, Request)]; what finished goes back as [(serial, rollouts)], or None at its end.
    def serve_start(self, numbered: list[tuple[int, Request]]) -> list[tuple[int, list[Rollout]]] | None:
        self.serve_close()
        self._serials: dict[int, tuple[int, Request]] = {}  # id(request) → (serial, request: kept alive)
        self._session = self.engine.serving(self._numbered(numbered))
        return self._answer(lambda: next(self._session))

    def serve_reply(self, numbered: list[tuple[int, Request]]) -> list[tuple[int, list[Rollout]]] | None:
        return self._answer(lambda: self._session.send(self._numbered(numbered)))

    def serve_close(self) -> None:
        session, self._session = getattr(self, "_session", None), None
        if session is not None:
            session.close()  # the adapter drops what is still running

    def _numbered(self, numbered: list[tuple[int, Request]]) -> list[Request]:
        self._serials.update((id(request), (serial, request)) for serial, request in numbered)
        return [request for _, request in numbered]

    def _answer(self, advance) -> list[tuple[int, list[Rollout]]] | None:
        try:
            finished = advance()
        except StopIteration:
            self._session = None
            return None
        return [(self._serials.pop(id(request))[0], rollouts) for request, rollouts in finished]

    def update_weights(self, bucket_refs: list) -> int:
        import ray

        buckets = ray.get(list(bucket_refs))  # refs nested in a list are not resolved by Ray itself
        pairs = [pair for packed in buckets for pair in unpack_bucket(packed)]
        self.engine.update_weights(pairs)  # the adapter's one full sync, flat (it buckets for itself)
        return len(pairs)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.engine.close()


@register("ray_fleet")
class RayEngineFleet(EngineAdapter):
    """`num_engines` Ray actors running `engine` with `engine_kwargs`; see the module docstring.

    `quantization` is engine 0's report (all engines run the same adapter and arguments).

    Args:
      engine: the registered adapter every actor runs (any but "ray_fleet").
      engine_kwargs: that adapter's constructor keywords; None: none.
      model_path: the start checkpoint, added to engine_kwargs as model_path; None: engine_kwargs has it.
      num_engines: engine actors; each generate call splits its prompts between them.
      resources_per_engine: the Ray resources of one actor (e.g. {"num_gpus": 1}); None: {"num_cpus": 1}.
      address: the Ray cluster `ray.init` connects to ("auto": the running one); None: Ray's default (a local
        one unless RAY_ADDRESS is set). Unused when Ray is already initialized.
      runtime_env: the Ray runtime environment of each actor; None: Ray's default.
      ray_init_kwargs: extra `ray.init` keywords; None: none.
      max_restarts: times a dead actor is replaced and its call retried, per call, before the error is raised.
      bucket_bytes: the most bytes of one object-store bucket of a weight push (a larger tensor goes alone).
      start_timeout_s: seconds to wait for the actors to start before FleetStartTimeoutError; None: no limit.
    """

    def __init__(self, *, engine: str = "vllm", engine_kwargs: dict[str, Any] | None = None,
                 model_path: str | None = None, num_engines: int = 1,
                 resources_per_engine: dict[str, Any] | None = None, address: str | None = None,
                 runtime_env: dict[str, Any] | None = None, ray_init_kwargs: dict[str, Any] | None = None,
                 max_restarts: int = 3, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 start_timeout_s: float | None = 1800.0):
        try:
            import ray
        except ImportError as e:
            raise ImportError("the ray_fleet engine needs Ray: pip install -e '.[ray]' (or 'ray>=2.40')") from e
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines} must be >= 1")
        if engine == "ray_fleet":
            raise ValueError("engine='ray_fleet' would nest fleets; name the adapter each actor runs, e.g. 'vllm'")
        self.engine_name = engine
        self.engine_kwargs = dict(engine_kwargs or {})
        if model_path is not None:  # train.py passes the checkpoint as model_path=
            self.engine_kwargs["model_path"] = str(model_path)
        self.resources_per_engine = dict({"num_cpus": 1} if resources_per_engine is None else resources_per_engine)
        self.runtime_env = runtime_env
        self.max_restarts = max_restarts
        self.bucket_bytes = bucket_bytes
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._actors: list = []
        self._weight_refs: list | None = None  # the last push, kept for restarted engines
        self._weights_known = True  # False after a push failed half-way: a restart could not recover them
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, **(ray_init_kwargs or {}))
        self._actor_cls = ray.remote(EngineHost)
        try:
            self._actors = [self._spawn() for _ in range(num_engines)]
            self._wait_started(self._actors)  # engines start in parallel
            self.quantization = ray.get(self._actors[0].quantization.remote())  # the engines' own report
            self.returns_sampling_support = ray.get(self._actors[0].returns_sampling_support.remote())
            self.max_model_len = ray.get(self._actors[0].max_model_len.remote())
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------------- actors
    def _spawn(self):
        options = dict(self.resources_per_engine)
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        return self._actor_cls.options(**options).remote(self.engine_name, self.engine_kwargs, ACTOR_ENV)

    def _wait_started(self, actors: list) -> None:
        import ray

        try:
            ray.get([a.pid.remote() for a in actors], timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise FleetStartTimeoutError(
                f"{len(actors)} engine actor(s) did not start within {self.start_timeout_s:.0f} s; each needs "
                f"{self.resources_per_engine} and the cluster has {ray.available_resources()} free: lower "
                "num_engines / resources_per_engine, add nodes, or raise start_timeout_s") from None

    def _restart(self, i: int) -> None:
        """Replaces actor i: a fresh engine on the checkpoint, then the last pushed weights."""
        import ray

        if not self._weights_known:
            raise RuntimeError(f"engine {i} died, and the last weight push did not complete, so the fleet has no "
                               "copy of the weights to restore; push the weights again before generating")
        try:
            ray.kill(self._actors[i], no_restart=True)
        except Exception:  # already gone
            pass
        actor = self._spawn()
        self._actors[i] = actor
        self.restarts += 1
        self._wait_started([actor])
        if self._weight_refs:
            ray.get(actor.update_weights.remote(self._weight_refs))

    def _get(self, i: int, ref, method: str, *args):
        """ray.get(ref) for a call to actor i; if the actor died, restart it and call `method` again."""
        import ray

        for attempt in range(self.max_restarts + 1):
            try:
                if attempt:
                    self._restart(i)
                    ref = getattr(self._actors[i], method).remote(*args)
                return ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if e.actor_init_failed or attempt == self.max_restarts:
                    raise
                warnings.warn(f"ray_fleet: engine {i} died during {method} ({type(e).__name__}); "
                              "restarting it with the last pushed weights and retrying")

    def _require_actors(self) -> list:
        if not self._actors:
            raise RuntimeError("this RayEngineFleet is closed; create a new one")
        return self._actors

    def _gather(self, calls: list) -> list:
        """Results of (engine index, ref, method, args) calls; waits for all before raising the first error."""
        results, error = [], None
        for i, ref, method, args in calls:
            try:
                results.append(self._get(i, ref, method, *args))
            except Exception as e:  # e.g. every engine rejecting a bad push: collect the others' replies too
                error = error or e
        if error is not None:
            raise error
        return results

    def _broadcast(self, method: str, *args) -> list:
        return self._gather([(i, getattr(a, method).remote(*args), method, args)
                             for i, a in enumerate(self._require_actors())])

    @property
    def num_engines(self) -> int:
        return len(self._actors)

    # ----------------------------------------------------------------------------------------- rollouts
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 seeds: Sequence[int] | None = None) -> list[Rollout]:
        actors = self._require_actors()
        prompts = check_prompts(prompt_token_ids)
        self.check_sampling(sampling)
        seeds = None if seeds is None else prompt_seeds(sampling, seeds, len(prompts))
        bounds = shard_bounds(len(prompts), len(actors))
        calls = []
        for i, (start, end) in enumerate(bounds):
            args = (prompts[start:end], shard_sampling(sampling, start), None if seeds is None else seeds[start:end])
            calls.append((i, actors[i].generate.remote(*args), "generate", args))
        rollouts = []
        for (start, _), shard in zip(bounds, self._gather(calls)):
            for r in shard:
                r.prompt_index += start  # shard-local → batch index
                rollouts.append(r)
        return rollouts

    def serving(self, requests: Sequence[Request]) -> Generator[Finished, Sequence[Request], None]:
        """One serving session per engine actor; finished requests are yielded as each actor answers, and
        their follow-ups go back to the actor that served them (module doc, "Serving" and "Faults")."""
        import ray

        actors = self._require_actors()
        serials = itertools.count()
        unanswered: list[dict[int, Request]] = [{} for _ in actors]  # per actor: serial → the caller's request
        waiting: dict = {}  # the ref of each actor's pending call → actor index
        live: set[int] = set()  # actors whose session is open
        restarts = [0] * len(actors)

        def numbered(i: int, batch: Sequence[Request]) -> list[tuple[int, Request]]:
            out = []
            for request in batch:
                check_prompts([request.prompt_token_ids])
                self.check_sampling(request.sampling)
                serial = next(serials)
                unanswered[i][serial] = request
                out.append((serial, request))
            return out

        try:
            requests = list(requests)
            for i, (start, end) in enumerate(shard_bounds(len(requests), len(actors))):
                waiting[actors[i].serve_start.remote(numbered(i, requests[start:end]))] = i
                live.add(i)
            while waiting:
                (ref,), _ = ray.wait(list(waiting), num_returns=1)
                i = waiting.pop(ref)
                try:
                    answered = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    if e.actor_init_failed or restarts[i] == self.max_restarts:
                        raise
                    restarts[i] += 1
                    warnings.warn(f"ray_fleet: engine {i} died during serving ({type(e).__name__}); restarting it "
                                  f"with the last pushed weights and sending it its {len(unanswered[i])} "
                                  "unanswered request(s) again")
                    self._restart(i)  # replaces actors[i]
                    waiting[actors[i].serve_start.remote(sorted(unanswered[i].items()))] = i
                    continue
                if answered is None:  # this actor's session ended: nothing of it is left
                    live.discard(i)
                    continue
                following = yield [(unanswered[i].pop(serial), rollouts) for serial, rollouts in answered]
                waiting[actors[i].serve_reply.remote(numbered(i, following))] = i
        finally:
            for i in live:  # the caller raised or closed the session: the actors drop theirs
                try:
                    ray.get(self._actors[i].serve_close.remote())
                except ray.exceptions.RayActorError:
                    pass

    # ----------------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[NamedTensor]) -> None:
        """One full sync from the flat pairs: this fleet's `bucket_bytes` buckets go into the object store
        once; every engine's adapter gets them back as one flat push (`EngineHost.update_weights`)."""
        import ray

        self._require_actors()
        self._weight_refs = None  # drop the previous push first: one copy of the weights in the store
        self._weights_known = False
        buckets = bucketed(named_tensor_pairs(named_tensors), self.bucket_bytes)
        refs = [ray.put(pack_bucket(bucket)) for bucket in buckets]
        self._weight_refs, self._weights_known = refs, True
        try:
            self._broadcast("update_weights", refs)
        except BaseException:  # rejected (e.g. WeightUpdateError) or engines lost: a restart can't reproduce
            self._weight_refs, self._weights_known = None, False  # the engines' state from these refs
            raise

    # ----------------------------------------------------------------------------------------- lifecycle
    def sleep(self) -> None:
        self._broadcast("sleep")

    def wake_up(self) -> None:
        self._broadcast("wake_up")

    def close(self) -> None:
        actors, self._actors = getattr(self, "_actors", []), []
        self._weight_refs = None
        if not actors and not getattr(self, "_owns_ray", False):
            return
        import ray

        for actor in actors:  # the process exits; the engine's memory goes with it
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass
