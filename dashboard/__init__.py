"""kvscope's dashboard (the last stage: ClickHouse → Streamlit): ``streamlit run dashboard/app.py``.

Pages read the store only through named queries (``sql/queries``) and, on the SQL page, read-only ad hoc SQL.
"""
