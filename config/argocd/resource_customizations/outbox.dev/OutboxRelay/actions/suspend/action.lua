-- spec.suspend: true. The operator scales the relay to zero (in-flight
-- batches finish); unpublished rows wait in the table.
if obj.spec == nil then
  obj.spec = {}
end
obj.spec.suspend = true
return obj
