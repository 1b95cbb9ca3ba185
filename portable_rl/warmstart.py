"""Entry point of the supervised warm start (the function lives in `portable_rl.rl.warmstart`).

    python -m portable_rl.warmstart --gin_file=gin/warmstart.gin [--gin.MODEL_PATH=DIR]

A tiny random policy trained briefly on a task's (prompt, answer) pairs; see `rl/warmstart.py`.
"""

from __future__ import annotations

from portable_rl.rl.warmstart import warmstart  # noqa: F401  (registered with gin when this module runs)


def main():
    import gin

    gin.get_configurable("warmstart")()


def cli(argv=None):
    """Console entry point: parses --gin_file / --gin.NAME=VALUE flags and runs the warm start."""
    from portable_rl import gin_utils

    gin_utils.run(main, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    cli()
