"""Pictures: ``charts`` (timelines, utilization, latency CDFs, block tables, the widget
explorer) and ``dashboard`` (live metrics from an engine or any OpenAI-compatible server;
its samples come from ``sources``, its drawing from ``panel``)."""
