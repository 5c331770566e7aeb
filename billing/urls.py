from django.urls import path, re_path

from billing import views

urlpatterns = [
    path("metrics", views.metrics_view, name="metrics"),
    re_path(r"^api/tenants/(?P<slug>[-\w]+)/reports/(?P<month>\d{4}-\d{2})\.(?P<fmt>csv|xlsx)$",
            views.TenantCostReportView.as_view(), name="tenant-cost-report"),
    re_path(r"^api/reports/(?P<month>\d{4}-\d{2})\.(?P<fmt>csv|xlsx)$",
            views.PlatformCostReportView.as_view(), name="platform-cost-report"),
]
