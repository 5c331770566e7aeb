"""One-use form ids for forms that create a secret (issue or rotate a key, issue a token, add a
webhook or rotate its secret, invite someone). The page showing the secret is the POST's own response, so a browser
reload re-sends the form: without this it would silently issue a second key, or rotate again and
kill the secret the user just copied. Each rendered form carries a random id; only its first submission acts.
"""

from __future__ import annotations

import secrets

from django.core.cache import cache
from django.http import HttpRequest

FORM_ID_FIELD = "form_id"
_REMEMBER_SECONDS = 86400
REPEATED_MESSAGE = ("This form was already submitted (the page was reloaded or sent twice); "
                    "nothing was done again, and a secret is never shown twice.")


def new_form_id() -> str:
    return secrets.token_urlsafe(16)


def first_submission(request: HttpRequest) -> bool:
    """True unless this rendered form was submitted before. A form without an id (a script
    posting directly) is always a first submission."""
    form_id = request.POST.get(FORM_ID_FIELD, "")
    if not form_id:
        return True
    return bool(cache.add(f"console:form-once:{form_id[:64]}", 1, timeout=_REMEMBER_SECONDS))
