from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("tenants", "0008_seed_plan_pace"),
    ]

    operations = [
        migrations.AddField(
            model_name="plan",
            name="responses_context_allowance_tokens",
            field=models.PositiveIntegerField(
                blank=True, null=True,
                help_text="Responses API: tokens held for the earlier turns of a "
                "previous_response_id or conversation this gateway has not seen (made "
                "elsewhere, or expired here). Empty: such a call is refused (400), since its "
                "context cannot be held for honestly."),
        ),
    ]
