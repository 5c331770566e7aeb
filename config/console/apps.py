from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The tenant-admin web console: an interface over the domain apps (no models of its own).
    An installed app so that its template tags and static files are found; its templates are
    in the top-level templates/ directory."""

    name = "config.console"
    label = "console"
