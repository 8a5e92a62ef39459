"""Pure functions over a report's tables: range loss, the recommendation, the gate, drift,
origins, plans, scaler replays, findings.
"""
