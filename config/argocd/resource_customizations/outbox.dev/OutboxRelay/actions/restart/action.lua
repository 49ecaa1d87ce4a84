-- A rolling restart of the relay pods, as `kubectl rollout restart` does for
-- a Deployment: a new restartedAt annotation in spec.podAnnotations changes
-- the pod template the operator writes.
local os = require("os")
if obj.spec == nil then
  obj.spec = {}
end
if obj.spec.podAnnotations == nil then
  obj.spec.podAnnotations = {}
end
obj.spec.podAnnotations["kubectl.kubernetes.io/restartedAt"] = os.date("!%Y-%m-%dT%XZ")
return obj
