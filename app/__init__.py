"""The k3lab Streamlit app: ``streamlit run app/main.py`` (or ``k3lab app``)."""
