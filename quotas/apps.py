from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "quotas"
    verbose_name = "Quota engine"

    def ready(self) -> None:
        # tenants/ cannot import quotas/ (imports run one way), so the tenants app's change
        # notices reach Redis through the transport plugged in here.
        from quotas.allotments import apply_allotments
        from quotas.cycles import plan_cycle_rule
        from quotas.invalidation import publish_invalidation
        from tenants import invalidation
        from tenants.services.allotments import set_allotments_applier
        from tenants.services.tenants import set_plan_cycle_rule

        invalidation.set_transport(publish_invalidation)
        # A plan change that changes the tenant's cycle waits for its current window to end.
        set_plan_cycle_rule(plan_cycle_rule)
        # A change of allotments reaches the live tiers at once (lua/allotments_set.lua).
        set_allotments_applier(apply_allotments)
