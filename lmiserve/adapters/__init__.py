"""One module per protocol: parse a wire payload into core request objects and formatting options."""
