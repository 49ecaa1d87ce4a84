-- spec.suspend: false. The relay runs its replicas again and publishes what waited.
if obj.spec == nil then
  obj.spec = {}
end
obj.spec.suspend = false
return obj
