"""A path merak-train names itself is accepted on its command line as printed: ``resume=<run>/.../step=10.ckpt``.

Hydra's grammar reads the ``=`` of ``step=10.ckpt`` as syntax ("mismatched input '=' expecting <EOF>", naming
neither the override nor the fix); check_overrides quotes such a path for it, and names the quoting for any other
value it cannot read.
"""

from __future__ import annotations

import pytest

from lightning_merak.cli.config import register_configs
from lightning_merak.cli.overrides import ConfigError, _compose, check_overrides

CHECKPOINT = "/runs/a/checkpoints/step=10.ckpt"


@pytest.fixture(autouse=True)
def _schemas():
    register_configs()


@pytest.mark.parametrize(
    ("argument", "key", "expected"),
    [
        (f"resume={CHECKPOINT}", "resume", CHECKPOINT),
        (f"+resume={CHECKPOINT}", "resume", CHECKPOINT),
        ("hydra.run.dir=/runs/lr=3e-4", None, None),
        ("output_dir=/runs/it's=1", "output_dir", "/runs/it's=1"),
        (f"resume='{CHECKPOINT}'", "resume", CHECKPOINT),  # quoted by the user: unchanged
        ("resume=auto", "resume", "auto"),
    ],
)
def test_a_path_with_an_equals_sign_is_quoted_for_hydra(argument, key, expected):
    lines = check_overrides([argument])
    assert len(lines) == 1 and lines[0].endswith(("'", '"', "auto")), lines
    if key is not None:
        assert _compose(lines)[key] == expected


def test_another_unreadable_value_is_refused_naming_it_and_the_quoting():
    with pytest.raises(ConfigError) as refusal:
        check_overrides(["trainer.max_steps=10", "model.config.rope_scaling=a=b"])
    assert str(refusal.value).startswith("model.config.rope_scaling=a=b: mismatched input '='"), refusal.value
    assert "goes in quotes: \"model.config.rope_scaling='a=b'\"" in str(refusal.value)
