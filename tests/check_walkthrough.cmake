# Placeholder: replaced by the walkthrough check.
execute_process(COMMAND "${PROGRAM}" RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "walkthrough failed")
endif()
