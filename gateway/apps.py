from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"
    verbose_name = "OpenAI-compatible gateway"

    def ready(self) -> None:
        # quotas/ cannot import gateway/ (imports run one way): the sweep task reports the holds
        # it ended to the request metrics through this hook.
        from quotas.tasks import set_swept_observer

        set_swept_observer(_count_swept)


def _count_swept(holds: int) -> None:
    # Imported when a sweep first ends a hold: processes that never sweep (the console, the
    # commands) need not load prometheus_client for it.
    from gateway.metrics import count_swept

    count_swept(holds)
