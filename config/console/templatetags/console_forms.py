from django import template
from django.utils.html import format_html

from config.console.one_use_forms import FORM_ID_FIELD, new_form_id

register = template.Library()


@register.simple_tag
def form_once() -> str:
    """A hidden one-use id for a form whose submission must act once (config/console/one_use_forms.py)."""
    return format_html('<input type="hidden" name="{}" value="{}">', FORM_ID_FIELD, new_form_id())
