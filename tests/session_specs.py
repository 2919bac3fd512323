"""Pipeline specs several test modules share."""

#: sessions with early, on-time and late panes and retractions: keys with and without stored windows, late
#: elements, and batch after batch the same ``current`` partitions touched
SESSIONS = {"window": {"type": "sessions", "gap": "5m"}, "aggregation": "sum",
            "trigger": "AtWatermark(early=AfterDelay('1m'), late=AtCount(1))",
            "accumulation": "accumulating_and_retracting", "batch_interval": "5m",
            "watermark": {"policy": "processing_time", "lag": "2m"}}
