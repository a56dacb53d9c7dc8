"""pipeline.model: what model building needs of transformers."""

from __future__ import annotations

import pytest


def test_missing_transformers_helpers_name_the_version_needed() -> None:
    from pipeline.errors import ConfigError
    from pipeline.model import transformers_helper

    assert callable(transformers_helper("transformers.initialization", "no_init_weights"))
    with pytest.raises(
        ConfigError, match=r"lacks transformers.integrations.deepspeed.gone.*install transformers>=5,<6"
    ):
        transformers_helper("transformers.integrations.deepspeed", "gone")
