# The ledger (billing_usagerecord) becomes a table partitioned by month on ended_at, its rows
# moved in (billing/partitions.py partition_existing: why and how), and the export log of
# retention (billing.LedgerExport).
#
# Plain migration operations, not a partitioning library: the one step is a table rebuild that
# PostgreSQL does in SQL (CREATE TABLE ... PARTITION BY, one INSERT ... SELECT), and the model
# stays an ordinary Django model. The database's primary key becomes (id, ended_at) and the
# unique request id becomes UNIQUE (request_id, ended_at); the model state keeps `id` as the pk
# (see billing/models.py UsageRecord.Meta) and records the new unique constraint and index.

from django.db import migrations, models


def forwards(apps, schema_editor) -> None:
    from billing.partitions import partition_existing

    with schema_editor.connection.cursor() as cursor:
        partition_existing(cursor)


def backwards(apps, schema_editor) -> None:
    from billing.partitions import TABLE, unpartition

    like_index = schema_editor._create_index_name(TABLE, ["request_id"], suffix="_like")
    with schema_editor.connection.cursor() as cursor:
        unpartition(cursor, like_index)


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0012_usage_rollup'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(forwards, backwards)],
            state_operations=[
                migrations.AlterField(
                    model_name='usagerecord',
                    name='request_id',
                    field=models.CharField(max_length=128),
                ),
                migrations.AddIndex(
                    model_name='usagerecord',
                    index=models.Index(fields=['request_id'], name='usage_request_id'),
                ),
                migrations.AddConstraint(
                    model_name='usagerecord',
                    constraint=models.UniqueConstraint(fields=('request_id', 'ended_at'),
                                                       name='usage_request_once'),
                ),
            ],
        ),
        migrations.CreateModel(
            name='LedgerExport',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('month', models.DateField(help_text="The month's first day (UTC).", unique=True)),
                ('rows', models.BigIntegerField()),
                ('sha256', models.CharField(help_text='Of the CSV file as written.', max_length=64)),
                ('path', models.CharField(max_length=1000)),
                ('exported_at', models.DateTimeField()),
                ('dropped_at', models.DateTimeField(blank=True, null=True)),
            ],
        ),
    ]
