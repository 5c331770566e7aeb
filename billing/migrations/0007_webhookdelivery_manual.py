from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("billing", "0006_prices_moved_to_gateway"),
    ]

    operations = [
        migrations.AddField(
            model_name="webhookdelivery",
            name="manual",
            field=models.BooleanField(default=False, help_text="Requested by a person (test event "
                                      "or redelivery)."),
        ),
    ]
