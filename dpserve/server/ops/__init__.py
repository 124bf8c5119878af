"""The operator routes: health, /metrics, /engines and the dashboard, the admin API."""
