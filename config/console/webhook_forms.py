"""Forms of the console's webhook pages (adding an endpoint, choosing its events, rotating its
signing secret)."""

from __future__ import annotations

from django import forms

from billing.models import WebhookEvent
from config.console.forms import GRACE_CHOICES

EVENT_HELP = {
    WebhookEvent.THRESHOLD.value: "a quota crossed one of the tenant's alert thresholds "
                                  "(set on the Limits page)",
    WebhookEvent.EXHAUSTED.value: "a quota has nothing left",
    WebhookEvent.TEST.value: "test events (the Send test event button always sends one)",
    WebhookEvent.BREAKER_TRIPPED.value: "a tenant, project or key spent far above its pace and "
                                        "was paused (burn-rate breaker)",
    WebhookEvent.FORECAST.value: "a quota is forecast to reach the tenant's forecast threshold "
                                 "by the end of its window (set on the Limits page)",
}


def event_choices() -> list[tuple[str, str]]:
    return [(value, f"{value}: {EVENT_HELP[value]}") for value in WebhookEvent.values]


class WebhookEventsForm(forms.Form):
    events = forms.MultipleChoiceField(
        choices=event_choices, required=False, widget=forms.CheckboxSelectMultiple,
        label="Events sent to this endpoint")


class WebhookCreateForm(WebhookEventsForm):
    url = forms.URLField(max_length=2000, label="Endpoint URL", assume_scheme="https",
                         help_text="Tollgate POSTs signed JSON here. Private and loopback "
                         "addresses are refused.",
                         widget=forms.URLInput(attrs={"placeholder": "https://example.com/hooks"}))
    field_order = ["url", "events"]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if not self.is_bound:
            self.initial.setdefault("events", [WebhookEvent.THRESHOLD.value,
                                               WebhookEvent.EXHAUSTED.value])


class WebhookRotateSecretForm(forms.Form):
    grace_seconds = forms.TypedChoiceField(
        label="Old secret stops signing", choices=GRACE_CHOICES, coerce=int, initial="86400",
        help_text="Until then every delivery carries a signature with each secret, so the "
        "receiver can switch to the new one without refusing an event.")
