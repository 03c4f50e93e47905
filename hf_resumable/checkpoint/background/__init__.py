"""Background saves: staging copies of the state and the step gate, then the commit off the loop."""
