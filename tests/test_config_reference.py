"""docs/reference/configuration.md is generated from the docstrings (portable_rl/config_reference.py): every
knob a gin file can bind has a one-line meaning, and the committed file is what the generator writes now."""

from portable_rl import config_reference


def test_every_knob_has_a_meaning_and_the_reference_is_current():
    text, missing = config_reference.render()
    assert not missing, f"knobs without a line in their owner's Args:/Attributes: section: {missing}"
    assert config_reference.REFERENCE.read_text() == text, \
        "docs/reference/configuration.md is stale: run python -m portable_rl.config_reference"


def test_docstring_sections_are_parsed_with_continuations():
    def f(*, a, b=1):
        """Does f.

        Args:
          a: the first
            knob, continued.
          b: the second.

        Returns nothing.
        """
    assert config_reference.documented_parameters(f) == {"a": "the first knob, continued.", "b": "the second."}
    assert config_reference.parameters(f) == [("a", config_reference.inspect.Parameter.empty), ("b", 1)]
