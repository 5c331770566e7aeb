from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "quotas"
    verbose_name = "Quota engine"

    def ready(self) -> None:
        # tenants/ cannot import quotas/ (imports run one way), so the tenants app's change
        # notices reach Redis through the transport plugged in here.
        from quotas.invalidation import publish_invalidation
        from tenants import invalidation

        invalidation.set_transport(publish_invalidation)
