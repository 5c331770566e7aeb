from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "quotas"
    verbose_name = "Quota engine"

    def ready(self) -> None:
        # tenants/ cannot import quotas/ (imports run one way), so the tenants app's change
        # notices reach Redis through the transport plugged in here.
        from quotas.cycles import plan_cycle_rule
        from quotas.invalidation import publish_invalidation
        from tenants import invalidation
        from tenants.services.tenants import set_plan_cycle_rule

        invalidation.set_transport(publish_invalidation)
        # A plan change that changes the tenant's cycle waits for its current window to end.
        set_plan_cycle_rule(plan_cycle_rule)
