"""The catalog learns token-class prices and Anthropic's models (public list prices, standard
tier, USD per 1M tokens as micro-dollars).

OpenAI models get their published cached-input price; reasoning output of the o-series costs the
output price (said explicitly); models without prompt caching (gpt-4, gpt-3.5-turbo, the
embeddings) keep null class prices, which means "the total's price". An entry is changed only
while it still has the prices 0002 seeded and no class price of its own: an operator's edit wins.

Anthropic models: cache writes (5-minute cache) cost 1.25x the input price, cache reads 0.1x;
thinking is billed as output (null reasoning price). Their tokenizer is not a tiktoken encoding:
the catalog's rule for such models is the conservative heuristic (gateway/tokens.py). The dated
snapshot names Anthropic's API also accepts become aliases. Existing entries of those names are
never overwritten, and the reverse deletes only the entries still exactly as seeded here.
"""

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

# Literal values, not imports: a migration keeps meaning what it meant when it was written.
# name, (input, output) as 0002 seeded them, cached input, cache write, reasoning
OPENAI_CLASS_PRICES = [
    ("gpt-4o", (2_500_000, 10_000_000), 1_250_000, None, None),
    ("gpt-4o-mini", (150_000, 600_000), 75_000, None, None),
    ("gpt-4.1", (2_000_000, 8_000_000), 500_000, None, None),
    ("gpt-4.1-mini", (400_000, 1_600_000), 100_000, None, None),
    ("o3-mini", (1_100_000, 4_400_000), 550_000, None, 4_400_000),
]

# name, dated alias, context, default output, max output, input, output, cached, cache write
ANTHROPIC_MODELS = [
    ("claude-sonnet-4-5", "claude-sonnet-4-5-20250929", 200_000, 4_096, 64_000,
     3_000_000, 15_000_000, 300_000, 3_750_000),
    ("claude-haiku-4-5", "claude-haiku-4-5-20251001", 200_000, 4_096, 64_000,
     1_000_000, 5_000_000, 100_000, 1_250_000),
    ("claude-opus-4-1", "claude-opus-4-1-20250805", 200_000, 4_096, 32_000,
     15_000_000, 75_000_000, 1_500_000, 18_750_000),
    ("claude-opus-4-5", "claude-opus-4-5-20251101", 200_000, 4_096, 64_000,
     5_000_000, 25_000_000, 500_000, 6_250_000),
]


# Null class prices (filtering on None is IS NULL).
UNPRICED_CLASSES = {"cached_input_micros_per_mtok": None, "cache_write_micros_per_mtok": None,
                    "reasoning_micros_per_mtok": None}


def add_class_prices(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    ModelSpec = apps.get_model("gateway", "ModelSpec")
    ModelAlias = apps.get_model("gateway", "ModelAlias")
    for name, (price_in, price_out), cached, write, reasoning in OPENAI_CLASS_PRICES:
        ModelSpec.objects.filter(
            name=name, input_price_micros_per_mtok=price_in,
            output_price_micros_per_mtok=price_out, **UNPRICED_CLASSES,
        ).update(cached_input_micros_per_mtok=cached, cache_write_micros_per_mtok=write,
                 reasoning_micros_per_mtok=reasoning)
    for (name, alias, context, default_out, max_out, price_in, price_out, cached,
         write) in ANTHROPIC_MODELS:
        spec, created = ModelSpec.objects.get_or_create(
            name=name,
            defaults={
                "tokenizer": "heuristic", "kind": "chat", "context_window": context,
                "default_output_tokens": default_out, "max_output_tokens": max_out,
                "input_price_micros_per_mtok": price_in,
                "output_price_micros_per_mtok": price_out,
                "cached_input_micros_per_mtok": cached, "cache_write_micros_per_mtok": write,
                "enabled": True,
            },
        )
        # Only for an entry made here, and only when the name is free (not a model of its own).
        if created and not ModelSpec.objects.filter(name=alias).exists():
            ModelAlias.objects.get_or_create(alias=alias, defaults={"model": spec})


def remove_class_prices(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    ModelSpec = apps.get_model("gateway", "ModelSpec")
    for name, (price_in, price_out), cached, write, reasoning in OPENAI_CLASS_PRICES:
        ModelSpec.objects.filter(
            name=name, input_price_micros_per_mtok=price_in,
            output_price_micros_per_mtok=price_out, cached_input_micros_per_mtok=cached,
            cache_write_micros_per_mtok=write, reasoning_micros_per_mtok=reasoning,
        ).update(**UNPRICED_CLASSES)
    # Only the entries that still carry exactly what add_class_prices seeded (tokenizer, kind,
    # windows, prices): an operator's entry of the same name (made before this migration, which
    # then left it alone, or edited since) is theirs and stays, with its aliases. A seeded entry
    # takes its aliases with it (CASCADE).
    for (name, _alias, context, default_out, max_out, price_in, price_out, cached,
         write) in ANTHROPIC_MODELS:
        ModelSpec.objects.filter(
            name=name, tokenizer="heuristic", kind="chat", context_window=context,
            default_output_tokens=default_out, max_output_tokens=max_out,
            input_price_micros_per_mtok=price_in, output_price_micros_per_mtok=price_out,
            cached_input_micros_per_mtok=cached, cache_write_micros_per_mtok=write,
            reasoning_micros_per_mtok=None,
        ).delete()


class Migration(migrations.Migration):
    dependencies = [("gateway", "0004_token_class_prices_provider_kind")]

    operations = [migrations.RunPython(add_class_prices, remove_class_prices)]
