"""Catalog rows with names as long as the model-name rule allows are saved and audited."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway.models import ModelAlias, ModelPrice, ModelSpec
from gateway.prices import MODEL_NAME_MAX_LENGTH, save_alias, save_model_spec, save_price
from tenants.models import AuditEvent

pytestmark = pytest.mark.django_db


def test_a_model_with_the_longest_allowed_name_is_saved_priced_and_aliased() -> None:
    # Fine-tuned model names are long ("ft:gpt-4o-mini:acme::abcdefgh"); the audit trail once
    # kept 32 characters of target, so any longer name failed to save at all.
    name = "ft:gpt-4o-mini:" + "a" * (MODEL_NAME_MAX_LENGTH - len("ft:gpt-4o-mini:"))
    spec = save_model_spec(ModelSpec(name=name, tokenizer="o200k_base", context_window=1000,
                                     default_output_tokens=10, max_output_tokens=100,
                                     input_price_micros_per_mtok=1,
                                     output_price_micros_per_mtok=2))
    save_price(ModelPrice(model=name, input_micros_per_mtok=3, output_micros_per_mtok=4,
                          valid_from=datetime(2026, 1, 1, tzinfo=UTC)))
    alias = "b" * MODEL_NAME_MAX_LENGTH
    save_alias(ModelAlias(alias=alias, model=spec))
    targets = set(AuditEvent.objects.values_list("target", flat=True))
    assert {name, alias} <= targets
    assert ModelSpec.objects.filter(name=name).exists()
    assert ModelAlias.objects.filter(alias=alias).exists()
