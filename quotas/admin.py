"""Django admin: a tenant's cycle and time zone, edited on the tenant's page.

tenants/admin.py registers the tenant's page; its cycle fields are changed through
quotas.cycles.change_cycle (the change rule needs the quota engine's calendar and clock, which
the tenants app cannot import), so the page is registered again here, with the cycle fields
validated against the plan on the form and saved through that service, after the tenant's own
services (tenants.admin.TenantAdmin.save_model) ran.

The form starts from what the tenant last asked for (quotas.cycles.asked_spec: a pending or
already switched change recorded in next_cycle, else its own fields), as the API and
`manage.py tenant_cycle` do: the tenant's own columns keep the cycle before a change until the
next change folds it, so a form filled from them would show a stale cycle and, saved with only a
new time zone, would ask the service to go back to it (cancelling or undoing the change).
"""

from __future__ import annotations

from datetime import date
from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.http import HttpRequest
from django.utils.html import format_html

from quotas.cycles import CycleSpec, asked_spec, change_cycle, check_cycle, cycle_standing
from tenants.admin import TenantAdmin
from tenants.models import Tenant, TenantCycle

_CYCLE_FIELDS = ("time_zone", "cycle", "cycle_anchor", "cycle_every_days")


class TenantCycleForm(forms.ModelForm):
    """The tenant's fields, with the cycle's optional: a blank time zone keeps the one last
    asked for. The cycle fields show what the tenant last asked for (`asked_spec`)."""

    time_zone = forms.CharField(
        required=False, max_length=64,
        help_text="IANA time zone of the tenant's days and cycle (e.g. Europe/Paris); blank: "
        "unchanged. A change waits for the current cycle window to end.")
    cycle = forms.ChoiceField(
        required=False, choices=TenantCycle.choices,
        help_text="A cycle of the tenant's own (plans that allow it: enterprise). A change waits "
        "for the current cycle window to end, unless the tenant counted nothing in it yet.")
    cycle_anchor = forms.DateField(
        required=False, help_text="Monthly: its day of the month starts each cycle (29-31: the "
        "last day of shorter months); weekly: its weekday; every N days: a first day.")
    cycle_every_days = forms.IntegerField(required=False, min_value=1, max_value=366,
                                          help_text="Every N days: N.")

    class Meta:
        model = Tenant
        fields = "__all__"

    # What the cycle fields ask for, read by clean() (None until then).
    cycle_spec: CycleSpec | None = None
    # What the tenant last asked for when the form was built: the fields start from it, and
    # saving asks the service for a change only if they differ from it.
    _before: CycleSpec | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self._before = asked_spec(self.instance)
            self.initial.update(self._before.fields())
        else:
            self._before = CycleSpec("", None, None, "UTC")

    def cycle_changed(self) -> bool:
        """Whether the cycle fields differ from what the tenant last asked for (a blank time zone
        does not)."""
        return self.cycle_spec is not None and self.cycle_spec != self._before

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        before = self._before or CycleSpec("", None, None, "UTC")
        zone = (cleaned.get("time_zone") or "").strip() or before.time_zone or "UTC"
        anchor: date | None = cleaned.get("cycle_anchor")
        self.cycle_spec = CycleSpec(cleaned.get("cycle") or "", anchor,
                                    cleaned.get("cycle_every_days"), zone)
        plan = cleaned.get("plan") or getattr(self.instance, "plan", None)
        if plan is not None and not self.errors and self.cycle_changed():
            try:
                check_cycle(self.cycle_spec, plan)
            except ValidationError as exc:
                for field, messages in exc.message_dict.items():
                    self.add_error(field if field != "every_days" else "cycle_every_days",
                                   messages)
        return cleaned

    def _post_clean(self) -> None:
        # The model's own validation would refuse a blank time zone; the service validates the
        # cycle fields (clean above), so the instance keeps the tenant's own values for them.
        for name in _CYCLE_FIELDS:
            self.cleaned_data.pop(name, None)
        super()._post_clean()


class CycleTenantAdmin(TenantAdmin):
    form = TenantCycleForm
    readonly_fields = (*TenantAdmin.readonly_fields, "cycle_now")

    @admin.display(description="Cycle now")
    def cycle_now(self, obj: Tenant) -> str:
        if obj.pk is None:
            return "-"
        standing = cycle_standing(obj)
        pending = ""
        if standing.pending is not None and standing.changes_at is not None:
            pending = (f"; changes to {standing.pending_description} ({standing.pending.zone}) "
                       f"at {standing.changes_at:%Y-%m-%d %H:%M %Z}")
        return format_html("{} ({}): window {}{}", standing.description, standing.cycle.zone,
                           standing.window.label, pending)

    def save_model(self, request: HttpRequest, obj: Tenant, form: TenantCycleForm,
                   change: bool) -> None:
        super().save_model(request, obj, form, change)
        spec = form.cycle_spec
        if spec is not None and form.cycle_changed():
            change_cycle(Tenant.objects.select_related("plan").get(pk=obj.pk),
                         cycle=spec.cycle, anchor=spec.anchor, every_days=spec.every_days,
                         time_zone=spec.time_zone, actor=f"user:{request.user.get_username()}")


admin.site.unregister(Tenant)
admin.site.register(Tenant, CycleTenantAdmin)
