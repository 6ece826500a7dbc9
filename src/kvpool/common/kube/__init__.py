"""Reading the Kubernetes API: list+watch of a few named objects, and the client's settings.

Used by the agent (quota and tenants ConfigMaps, its peers' pods), the prefix index (agent
pods), the doctor and the operator.
"""
