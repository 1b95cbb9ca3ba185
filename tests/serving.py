"""What the serving tests share (engines/base.py, "Serving"): a respond that logs, a follow-up chain of short
requests, an engine served in waves, the batch of one generate call as requests, and a countdown environment."""

from __future__ import annotations

import dataclasses

from portable_rl.engines.base import Request, drive, in_waves
from portable_rl.environments import Environment, Step


def serve_log(engine, requests, follow_up, serve=None):
    """engine.serve(requests, respond) with a respond that logs every finished request (in order, with the
    number of the respond call) and sends `follow_up(request, rollouts)` (a Request or None) for each."""
    log, calls = [], [0]

    def respond(finished):
        calls[0] += 1
        log.extend((calls[0], request, rollouts) for request, rollouts in finished)
        return [r for r in (follow_up(request, rollouts) for request, rollouts in finished) if r is not None]

    (serve or engine.serve)(requests, respond)
    return log


def short_chain(short, length: int = 4):
    """A follow-up for `serve_log`: each finished `short` request with key k < length - 1 is followed by key
    k + 1 (its prompt + response, seed short.seed + k + 1); any other request by nothing."""

    def follow_up(request, rollouts):
        if request.sampling.max_tokens == short.max_tokens and request.key < length - 1:
            return Request(request.key + 1, request.prompt_token_ids + rollouts[0].response_token_ids,
                           dataclasses.replace(short, seed=short.seed + request.key + 1))
        return None

    return follow_up


def batch_requests(prompts, sampling):
    """One generate call's prompts as serve requests: the batch rule's seeds, key = prompt index."""
    return [Request(i, p, dataclasses.replace(sampling, seed=sampling.seed_for(i))) for i, p in enumerate(prompts)]


class Waves:
    """An engine served `in_waves` (the default serving: one generate call per turn), not by its own."""

    def __init__(self, engine):
        self.engine = engine

    def serve(self, requests, respond):
        drive(in_waves(self.engine, requests), respond)

    def __getattr__(self, name):
        return getattr(self.engine, name)


class Countdown(Environment):
    """Done after `answer` turns; each earlier turn is answered `left k`."""

    def reset(self, example):
        self.left = int(example.answer)
        return example.prompt

    def step(self, action_text):
        self.left -= 1
        return Step(None, 1.0, True, {}) if self.left == 0 else Step(f"left {self.left}", 0.0, False, {})
