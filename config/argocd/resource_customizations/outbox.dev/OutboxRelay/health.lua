-- Argo CD health check for outbox.dev/OutboxRelay, read from the conditions
-- the operator writes. Install it as resource.customizations.health.outbox.dev_OutboxRelay
-- in argocd-cm (docs/operator.md shows the snippet).
--   Suspended   spec.suspend is true and the Deployment counts no replica,
--               or reconciliation is paused
--               (outbox.dev/reconcile: disabled, condition ReconciliationPaused)
--   Degraded    Stalled (invalid spec, missing Secret, a child the API
--               server refused, rollout past its deadline, ready replicas
--               that publish nothing, also once they turned unready),
--               Lagging (rows
--               wait past spec.lagThreshold), or, once rolled out, a backlog
--               the operator cannot read
--   Progressing the operator has not seen this generation, is rolling out or
--               scaling (Reconciling), or has not read the backlog yet
--   Healthy     Ready, and events flow (Lagging False)
local hs = {}

local function condition(type)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == type then
      return c
    end
  end
  return nil
end

local function describe(c)
  local text = c.reason or ""
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

-- Suspended once the Deployment counts no replica (status.replicas, which
-- leaves out pods still terminating within their grace period): until
-- then, or while the operator cannot scale it down, the conditions below
-- say what goes on.
local running = 0
if obj.status ~= nil and obj.status.replicas ~= nil then
  running = obj.status.replicas
end
if obj.spec ~= nil and obj.spec.suspend == true and running == 0 then
  hs.status = "Suspended"
  hs.message = "spec.suspend is true: the relay runs no pods"
  return hs
end

-- outbox.dev/reconcile: disabled: the operator changes nothing, so the
-- conditions may be old; say so rather than judge by them.
local paused = condition("ReconciliationPaused")
if paused ~= nil and paused.status == "True" then
  hs.status = "Suspended"
  hs.message = describe(paused)
  return hs
end

local generation = obj.metadata.generation or 0
if obj.status == nil or obj.status.observedGeneration == nil or obj.status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the current generation"
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled)
  return hs
end

local lagging = condition("Lagging")
if lagging ~= nil and lagging.status == "True" then
  hs.status = "Degraded"
  hs.message = "Lagging, " .. describe(lagging)
  return hs
end

local reconciling = condition("Reconciling")
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(reconciling)
  return hs
end

-- The operator does not read this backlog by choice (its own cloud identity
-- logs in nowhere by default): the pods' readiness decides.
if lagging ~= nil and lagging.status == "Unknown" and lagging.reason == "BacklogNotRead" then
  local ready = condition("Ready")
  if ready ~= nil and ready.status == "True" then
    hs.status = "Healthy"
    hs.message = describe(ready) .. "; the operator does not read the backlog (" .. lagging.reason .. ")"
    return hs
  end
end

if lagging ~= nil and lagging.status == "Unknown" and lagging.reason == "BacklogUnavailable" then
  hs.status = "Degraded"
  hs.message = describe(lagging)
  return hs
end

if lagging == nil or lagging.status ~= "False" then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to read the backlog"
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready) .. "; " .. lagging.message
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = describe(ready)
else
  hs.message = "Waiting for the Ready condition"
end
return hs
