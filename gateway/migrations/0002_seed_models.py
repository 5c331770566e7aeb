"""Seed the model catalog with OpenAI's public list prices (standard tier, USD per 1M tokens,
as micro-dollars). Operators edit or extend it in the admin afterwards.

Default output reservations: 4096 for chat models (what a typical answer fits in, and the
maximum of the older models); 25,000 for o3-mini, the room OpenAI recommends reserving for
reasoning plus output. Embedding models produce no output tokens.
"""

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

# Literal values, not imports from gateway.models: a migration must keep meaning what it meant
# when it was written, whatever the models later become.
SEEDED_MODELS = [
    # name, tokenizer, kind, context, default output, max output, input $/1M, output $/1M (micros)
    ("gpt-4o", "o200k_base", "chat", 128_000, 4_096, 16_384, 2_500_000, 10_000_000),
    ("gpt-4o-mini", "o200k_base", "chat", 128_000, 4_096, 16_384, 150_000, 600_000),
    ("gpt-4.1", "o200k_base", "chat", 1_047_576, 4_096, 32_768, 2_000_000, 8_000_000),
    ("gpt-4.1-mini", "o200k_base", "chat", 1_047_576, 4_096, 32_768, 400_000, 1_600_000),
    ("o3-mini", "o200k_base", "chat", 200_000, 25_000, 100_000, 1_100_000, 4_400_000),
    ("gpt-3.5-turbo", "cl100k_base", "chat", 16_385, 4_096, 4_096, 500_000, 1_500_000),
    ("gpt-4", "cl100k_base", "chat", 8_192, 4_096, 8_192, 30_000_000, 60_000_000),
    ("text-embedding-3-small", "cl100k_base", "embedding", 8_191, 0, 0, 20_000, 0),
    ("text-embedding-3-large", "cl100k_base", "embedding", 8_191, 0, 0, 130_000, 0),
]


def seed_models(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    ModelSpec = apps.get_model("gateway", "ModelSpec")
    for name, tokenizer, kind, context, default_out, max_out, price_in, price_out in SEEDED_MODELS:
        # get_or_create: never overwrite an entry an operator already made under that name.
        ModelSpec.objects.get_or_create(
            name=name,
            defaults={
                "tokenizer": tokenizer,
                "kind": kind,
                "context_window": context,
                "default_output_tokens": default_out,
                "max_output_tokens": max_out,
                "input_price_micros_per_mtok": price_in,
                "output_price_micros_per_mtok": price_out,
                "enabled": True,
            },
        )


def unseed_models(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    ModelSpec = apps.get_model("gateway", "ModelSpec")
    ModelSpec.objects.filter(name__in=[row[0] for row in SEEDED_MODELS]).delete()


class Migration(migrations.Migration):
    dependencies = [("gateway", "0001_initial")]

    operations = [migrations.RunPython(seed_models, unseed_models)]
