-- Argo CD resource actions for outbox.dev/OutboxRelay: suspend and resume
-- (spec.suspend: the relay runs no pods, nothing is lost, rows wait), and
-- restart (a rolling restart of the relay pods).
local actions = {}
local suspended = obj.spec ~= nil and obj.spec.suspend == true
actions["suspend"] = {["disabled"] = suspended}
actions["resume"] = {["disabled"] = not suspended}
actions["restart"] = {["disabled"] = suspended}
return actions
