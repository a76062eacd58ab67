"""The atomd PD router: an OpenAI-compatible front door that runs every request as a
prefill leg on one engine and a decode leg on another (see router/pd.py)."""
