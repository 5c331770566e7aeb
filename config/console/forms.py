"""Forms of the projects, keys, limits and tokens pages. They parse input only: the limits a
value must respect are checked by tenants.services, whose ValidationErrors land back on the form
through add_service_errors()."""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError

_SUB_LIMIT_HELP = "Leave empty for no limit of its own."

GRACE_CHOICES: list[tuple[str, str]] = [
    ("0", "Immediately"),
    ("3600", "After 1 hour"),
    ("86400", "After 24 hours"),
    ("604800", "After 7 days"),
]


def _sub_limit(label: str) -> forms.IntegerField:
    return forms.IntegerField(label=label, required=False, min_value=0, help_text=_SUB_LIMIT_HELP)


def _allotment(label: str, window: str) -> forms.IntegerField:
    return forms.IntegerField(
        label=label, required=False, min_value=0,
        help_text=f"Tokens {window} reserved for it alone out of the tenant's quota; what it "
        "needs beyond them is borrowed from the shared pool. Empty: none.")


def _day_allotment() -> forms.IntegerField:
    return _allotment("Allotment per day", "per day")


def _cycle_allotment() -> forms.IntegerField:
    return _allotment("Allotment per cycle", "per cycle (the tenant's month)")


def _pace_share() -> forms.IntegerField:
    return forms.IntegerField(
        label="Pace share (%)", required=False, min_value=1, max_value=100,
        help_text="Burn-rate breaker: at most this percent of its daily limit per pace period. "
        "Empty: the tenant's; 100: no pace of its own.")


def _pace_spend() -> forms.IntegerField:
    return forms.IntegerField(
        label="Spend pace (micro-dollars per period)", required=False, min_value=1,
        help_text="Empty: no spend pace of its own.")


def add_service_errors(form: forms.Form, error: ValidationError) -> None:
    """Put a service's ValidationError on the form: per field where the form has the field."""
    if hasattr(error, "error_dict"):
        for name, errors in error.error_dict.items():
            form.add_error(name if name in form.fields else None, errors)
    else:
        form.add_error(None, error.messages)


class ProjectForm(forms.Form):
    slug = forms.SlugField(
        max_length=63, help_text="Lowercase letters, digits and hyphens; it cannot change later."
    )
    name = forms.CharField(max_length=200, required=False)
    tokens_per_day = _sub_limit("Tokens per day")
    tokens_per_month = _sub_limit("Tokens per month")
    allotment_tokens_per_day = _day_allotment()
    allotment_tokens_per_month = _cycle_allotment()


class ProjectLimitsForm(forms.Form):
    tokens_per_day = _sub_limit("Tokens per day")
    tokens_per_month = _sub_limit("Tokens per month")
    pace_share_percent = _pace_share()
    pace_spend_micros = _pace_spend()
    allotment_tokens_per_day = _day_allotment()
    allotment_tokens_per_month = _cycle_allotment()


class IssueKeyForm(forms.Form):
    name = forms.CharField(
        max_length=200, required=False, help_text="What the key is for, e.g. ci or production."
    )


class KeyLimitsForm(forms.Form):
    name = forms.CharField(max_length=200, required=False)
    tokens_per_day = _sub_limit("Tokens per day")
    tokens_per_month = _sub_limit("Tokens per month")
    requests_per_minute = _sub_limit("Requests per minute")
    max_concurrency = _sub_limit("Concurrent requests")
    pace_share_percent = _pace_share()
    pace_spend_micros = _pace_spend()
    allotment_tokens_per_day = _day_allotment()
    allotment_tokens_per_month = _cycle_allotment()
    allowed_models = forms.CharField(
        required=False,
        label="Allowed models",
        help_text="Comma-separated model names; empty means every model the plan allows.",
    )

    def clean_allowed_models(self) -> list[str]:
        models = [m.strip() for m in self.cleaned_data["allowed_models"].split(",") if m.strip()]
        if len(set(models)) != len(models):
            raise ValidationError("Model names must not repeat.")
        return models

    @staticmethod
    def initial_for(api_key: Any) -> dict[str, Any]:
        return {
            "name": api_key.name,
            "tokens_per_day": api_key.tokens_per_day,
            "tokens_per_month": api_key.tokens_per_month,
            "requests_per_minute": api_key.requests_per_minute,
            "max_concurrency": api_key.max_concurrency,
            "pace_share_percent": api_key.pace_share_percent,
            "pace_spend_micros": api_key.pace_spend_micros,
            "allotment_tokens_per_day": api_key.allotment_tokens_per_day,
            "allotment_tokens_per_month": api_key.allotment_tokens_per_month,
            "allowed_models": ", ".join(api_key.allowed_models),
        }


class RotateKeyForm(forms.Form):
    grace_seconds = forms.TypedChoiceField(
        label="Old secret stops working",
        choices=GRACE_CHOICES,
        coerce=int,
        initial="0",
        help_text="A grace period lets clients switch to the new secret before the old one dies.",
    )


class RevokeKeyForm(forms.Form):
    confirm = forms.BooleanField(
        label="I understand that every client using this key will be refused at once.",
        required=True,
    )


class AlertThresholdsForm(forms.Form):
    alert_thresholds = forms.CharField(
        label="Alert thresholds (percent remaining)",
        required=False,
        help_text="Comma-separated, e.g. 10, 5: alert when 10% and again when 5% of a quota "
        "or budget remains. Empty: no alerts.",
    )

    def clean_alert_thresholds(self) -> list[int]:
        raw = [part.strip() for part in self.cleaned_data["alert_thresholds"].split(",")]
        try:
            values = [int(part) for part in raw if part]
        except ValueError:
            raise ValidationError("Enter whole numbers separated by commas.") from None
        return sorted(values, reverse=True)

    forecast_threshold_percent = forms.IntegerField(
        label="Forecast warning (percent of a limit)",
        min_value=0,
        max_value=100,
        required=False,  # left out: unchanged
        help_text="Warn (email and the quota.forecast webhook, once per window) when a quota's "
        "forecast for the end of its window reaches this percent of its limit. 0: no forecast "
        "warnings.",
    )


class ManagementTokenForm(forms.Form):
    name = forms.CharField(max_length=200, help_text="What the token is for, e.g. terraform.")


class AuditFilterForm(forms.Form):
    """GET filters of the audit page: ?from=YYYY-MM-DD&to=YYYY-MM-DD&action=key.issued&actor=."""

    action = forms.ChoiceField(required=False)
    actor = forms.CharField(required=False, max_length=200, help_text="e.g. user:alice or token:")

    def __init__(self, *args: Any, actions: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "from" is a Python keyword, so these two are added here rather than declared above.
        self.fields["from"] = forms.DateField(required=False, label="From",
                                              widget=forms.DateInput(attrs={"type": "date"}))
        self.fields["to"] = forms.DateField(required=False, label="To",
                                            widget=forms.DateInput(attrs={"type": "date"}))
        self.order_fields(["from", "to", "action", "actor"])
        self.fields["action"].choices = [("", "Any action"), *((a, a) for a in actions)]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        start, end = data.get("from"), data.get("to")
        if start and end and start > end:
            self.add_error("to", "Must not be before the start date.")
        return data


class KeyFilterForm(forms.Form):
    """GET filters of the keys page: ?q=&project=&status=&used=&sort=&per_page= (and page,
    read apart: config/console/paging.py). Every choice is a closed list, so a junk value is a
    form error (a 400 naming the field), never a query."""

    q = forms.CharField(required=False, max_length=200, label="Search",
                        help_text="Part of a key's name, or its id (key_...).")
    # The message does not echo the value: another tenant's project id reads as a missing one.
    project = forms.ChoiceField(required=False, error_messages={
        "invalid_choice": "No such project in this tenant."})
    status = forms.ChoiceField(required=False)
    used = forms.ChoiceField(required=False, label="Last used")
    sort = forms.ChoiceField(required=False, label="Order")
    per_page = forms.TypedChoiceField(required=False, label="Per page", coerce=int,
                                      empty_value=None)

    def __init__(self, *args: Any, projects: list[tuple[str, str]], statuses: tuple[str, ...],
                 last_use: tuple[str, ...], orders: tuple[str, ...],
                 page_sizes: tuple[int, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        labels = {"day": "In the last 24 hours", "week": "In the last 7 days",
                  "month": "In the last 30 days", "idle": "Not in the last 30 days",
                  "never": "Never", "newest": "Newest first", "oldest": "Oldest first",
                  "name": "Name", "last_used": "Last used"}
        self.fields["project"].choices = [("", "Every project"), *projects]
        self.fields["status"].choices = [("", "Any status"), *((s, s) for s in statuses)]
        self.fields["used"].choices = [("", "Any time"),
                                       *((u, labels.get(u, u)) for u in last_use)]
        self.fields["sort"].choices = [(o, labels.get(o, o)) for o in orders]
        self.fields["per_page"].choices = [(str(n), str(n)) for n in page_sizes]
