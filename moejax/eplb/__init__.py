"""Expert-parallel load balancing: statistics, balanced placement, online rebalancing."""
