"""The quota engine keeps its counters in Redis; PostgreSQL keeps one thing of its own: the cycles
a tenant's windows ran on before a change (quotas/cycles.py), so the report of a past window is
cut where the gateway cut its counters."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class CyclePeriod(models.Model):
    """One span in which a tenant's windows followed one cycle: written when a change of cycle,
    time zone or plan is scheduled (the span of the cycle in force ends at the switch), and
    rewritten while its end is still ahead (a second change replaces the pending one). The span
    after the last row is the tenant's own fields (quotas.cycles.schedule_for)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE,
                               related_name="cycle_periods")
    kind = models.CharField(max_length=8, help_text="quotas.windows.CycleKind: monthly or days.")
    anchor = models.DateField()
    every_days = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(366)])
    time_zone = models.CharField(max_length=64)
    starts_at = models.DateTimeField(
        null=True, blank=True, help_text="Empty: since the tenant's first window.")
    ends_at = models.DateTimeField()

    class Meta:
        ordering = ["tenant_id", "ends_at"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "ends_at"], name="cycle_period_one_end"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.kind} {self.anchor} until {self.ends_at:%Y-%m-%d %H:%M}"
