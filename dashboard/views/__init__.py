"""Dashboard pages, one module per page (run by st.navigation from dashboard/app.py)."""
