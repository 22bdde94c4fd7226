"""ROS 2 glue: parameters, QoS, subscriptions, publishers and message conversions."""
